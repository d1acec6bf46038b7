"""A sharded (torch.distributed.checkpoint) training state read whole by one process: the
entries FSDP2 writes (`params/NAME`, `exp_avg/NAME`, `exp_avg_sq/NAME`, `step`) come back as
the consolidated checkpoint's dict, and a checkpoint directory holding `training/` instead
of `training.pt` loads through the runtime's reader (the 2-rank writing and resharding:
tests/distributed/test_dist_engines.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rlhf_dist.checkpoint import SHARDS, Checkpoint
from rlhf_dist.distributed.training_state import read_full_state

# dcp.save in one process says it assumes one process: that is what these tests do
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class OneRank:
    rank, world_size, is_main = 0, 1, True

    def barrier(self) -> None:
        pass

    def seed_per_rank(self, seed: int) -> None:
        pass


def entries() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(3, 2, generator=g), torch.randn(3, generator=g)
    return {
        "step": torch.tensor(7),
        "params/lin.weight": w,
        "params/lin.bias": b,
        "exp_avg/lin.weight": w / 10,
        "exp_avg_sq/lin.weight": w * w,
    }


def test_shards_read_whole_are_the_consolidated_state(tmp_path):
    saved = entries()
    dcp.save(saved, checkpoint_id=tmp_path / SHARDS, no_dist=True)
    state = read_full_state(tmp_path / SHARDS)
    assert state["step"] == 7
    assert sorted(state["params"]) == ["lin.bias", "lin.weight"]
    assert torch.equal(state["params"]["lin.weight"], saved["params/lin.weight"])
    assert torch.equal(state["exp_avg"]["lin.weight"], saved["exp_avg/lin.weight"])
    assert torch.equal(state["exp_avg_sq"]["lin.weight"], saved["exp_avg_sq/lin.weight"])
    assert state["exp_avg"].keys() == {"lin.weight"}  # no moment saved, none made up


def test_a_sharded_checkpoint_loads_through_the_reader(tmp_path):
    dcp.save(entries(), checkpoint_id=tmp_path / SHARDS, no_dist=True)
    torch.save({"scheduler": {}}, tmp_path / "trainer.pt")
    (tmp_path / "meta.json").write_text(json.dumps({"format": 1, "step": 1, "world_size": 2}))
    whole = Checkpoint(tmp_path, OneRank(), read_full_state)
    assert whole.shards == tmp_path / SHARDS and whole.training is not None
    module = torch.nn.Module()
    module.lin = torch.nn.Linear(2, 3)
    whole.load_weights_into(module)
    assert torch.equal(module.lin.bias.detach(), entries()["params/lin.bias"])
    # FSDP2's reader returns None: the weights are read into the shards after prepare
    later = Checkpoint(tmp_path, OneRank(), lambda _: None)
    fresh = torch.nn.Linear(2, 3)
    before = fresh.weight.detach().clone()
    later.load_weights_into(fresh)
    assert later.training is None and torch.equal(fresh.weight.detach(), before)
