"""Two ranks train the module-list MoE of tests/moe_models.py under ZeRO-3 (every
parameter partitioned: stage3_param_persistence_threshold 0), rank 0 on tokens that all
route to expert 0, rank 1 on tokens that route to experts 1 and 2.

Usage: moe_leaf_probe.py OUT on|off [COMMANDS]
on: the model goes through models/moe.py `prepare_moe` as loading does (its sparse
block a ZeRO-3 leaf); off: it does not (DeepSpeed fetches each expert as it runs).
COMMANDS, a JSON list of `rlhf-dist STAGE ARGS` argument lists, run after the probe in
the same process group (scripts/run_stages.py), sparing a launch of their own.
Each rank writes OUT.RANK: {"experts": experts its tokens chose, "losses": per step,
"changed": whether the expert weights moved}. With off, rank 1 fetches one expert more
than rank 0: the ranks' collectives no longer match (a hang or an error).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: moe_models

from moe_models import routed_model  # noqa: E402

from rlhf_dist.distributed import Runtime  # noqa: E402
from rlhf_dist.distributed.process_exit import end_process  # noqa: E402
from rlhf_dist.models.moe import prepare_moe  # noqa: E402


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    # off: a hang shows as gloo timing out after 8 s rather than the default 30 minutes
    runtime = Runtime(seed=0, num_threads=1, timeout_s=120 if mode == "on" else 8)
    model = routed_model()
    if mode == "on":
        prepare_moe(model, None, "model.policy")
    before = {k: v.clone() for k, v in model.state_dict().items() if "experts" in k}
    seen: set[int] = set()
    model.moe.gate.register_forward_hook(
        lambda _m, _a, logits: seen.update(torch.topk(logits, 1).indices.flatten().tolist())
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    # micro-batch 2, accumulation 2: DeepSpeed's batch entries, filled at the first
    # prepare, hold for every engine of the process, the SFT of COMMANDS's among them (the
    # probe marks each step's end itself: one micro-batch per step)
    model, optimizer = runtime.prepare(model, optimizer, 2, 2, 1.0, "float32")
    tokens = [0, 4, 8, 12] if runtime.rank == 0 else [1, 5, 2, 6]  # experts {0} / {1, 2}
    ids = torch.tensor([tokens * 2])
    losses = []
    for _ in range(2):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        runtime.micro_backward(model, loss, last=True)
        runtime.optimizer_step(model, optimizer, [1.0])
        losses.append(float(loss.detach()))
    after = runtime.full_state_dict(model)  # every rank gathers: a collective
    changed = (
        None if after is None else [not torch.equal(v, after[k].cpu()) for k, v in before.items()]
    )
    result = {"experts": sorted(seen), "losses": losses, "changed": changed}
    Path(f"{out}.{runtime.rank}").write_text(json.dumps(result))
    runtime.barrier()


if __name__ == "__main__":
    main()
    if len(sys.argv) > 3:
        from run_stages import run  # this script's directory is on the path

        for command in json.loads(sys.argv[3]):
            run(command)
    sys.exit(end_process(0))
