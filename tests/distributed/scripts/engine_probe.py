"""Build this launch's engine on a tiny Llama and take one optimizer step.

Usage: engine_probe.py OUT. Run under `accelerate launch` with any shipped CPU config,
from any working directory: rank 0 writes {"engine": the runtime's engine name,
"world_size": ..., "loss": the step's loss, "changed": whether every trained weight moved}
to OUT (json). Both ranks see the same rows, so the loss is the same on each.
"""

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_dist.distributed import Runtime
from rlhf_dist.distributed.process_exit import end_process


def main(out: str) -> None:
    runtime = Runtime(seed=0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = runtime.prepare(model, optimizer, 2, 1, 1.0, "float32")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    runtime.micro_backward(model, loss, last=True)
    runtime.optimizer_step(model, optimizer, [1.0])
    after = runtime.full_state_dict(model)
    if runtime.is_main:
        changed = all(not torch.equal(after[n].float(), before[n]) for n in before if n in after)
        result = {
            "engine": runtime.engine,
            "world_size": runtime.world_size,
            "loss": float(loss.detach()),
            "changed": changed,
        }
        with open(out, "w") as f:
            json.dump(result, f)
    runtime.close()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.exit(end_process(0))  # gloo and interpreter exit: distributed/process_exit.py
