"""distributed.sequence_parallel_size=2 on 2 CPU ranks (gloo, DDP) gives the loss and the
gradient of sequence_parallel_size=1, to 1e-5, for one optimizer step of SFT, DPO, KTO and
the GRPO update on 2K-token sequences, padded and packed, and the rollout's scoring gives
the same log-probs and entropies (docs/distributed.md "Sequence parallelism"). One launch
of scripts/sp_probe.py computes every case."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, free_port, launch_args, run_launch

PROBE = str(REPO / "tests" / "distributed" / "scripts" / "sp_probe.py")
# score: the rollout's scoring forwards; kto and score on padded rows only (sp_probe.py)
CASES = [(case, "padded") for case in ("sft", "dpo", "kto", "grpo", "score")]
CASES += [(case, "packed") for case in ("sft", "dpo", "grpo")]


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sp") / "probe.pt"
    run_launch(launch_args("cpu_ddp.yaml", free_port(), PROBE, str(out), "2048"), timeout=240)
    return torch.load(out)


@pytest.mark.parametrize(("case", "layout"), CASES)
def test_sequence_parallel_gives_the_same_loss_and_gradient(probe, case, layout):
    one, two = probe[f"{case}/sp1/{layout}"], probe[f"{case}/sp2/{layout}"]
    assert abs(two["loss"] - one["loss"]) <= 1e-5
    assert one["tensors"].keys() == two["tensors"].keys()
    for name, g in one["tensors"].items():
        assert g.abs().max() > 0, name  # every weight gets a gradient: a real comparison
        torch.testing.assert_close(two["tensors"][name], g, rtol=0, atol=1e-5, msg=name)
        # and relative to the tensor's own size (some gradients are ~1e-4 here)
        assert (two["tensors"][name] - g).norm() <= 1e-4 * g.norm(), name
