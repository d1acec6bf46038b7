"""Ranks that stop generating at different steps must not hang each other (ZeRO-3).

Usage: uneven_generation.py POLICY REWARD PROMPTS
Rank 0 generates ONE token per prompt; rank 1 is forced to run to 16 tokens. Then both
score the rollout and take an optimizer step (collectives that need every rank), and
print a line the test looks for. Both generation modes run, one after the other in this
one process: weights gathered for generation, then per-layer (synced) fetching. The tests
run `uneven_rollout_and_step` inside grad_probe.py's ZeRO-3 launch (--uneven-generation).
"""

import sys

import torch

from rlhf_dist.config import config_from_dict
from rlhf_dist.data.batching import ppo_plan
from rlhf_dist.data.rows import load_rows, prompt_set
from rlhf_dist.distributed import Runtime
from rlhf_dist.distributed.process_exit import end_process
from rlhf_dist.models import load_tokenizer, quiet_transformers
from rlhf_dist.rollout import PromptBatch, RolloutModels, collect_rollout
from rlhf_dist.trainers.common import step_and_schedule
from rlhf_dist.trainers.ppo.setup import build_models
from rlhf_dist.trainers.ppo.update import UpdateKnobs, minibatch_backward


def main():
    policy, reward, prompts_path = sys.argv[1:4]
    quiet_transformers()
    runtime = Runtime(seed=0, num_threads=1)
    for gather in (True, False):
        widths = uneven_rollout_and_step(runtime, policy, reward, prompts_path, gather)
        runtime.print(f"UNEVEN-OK gather={gather} widths={widths}")


def uneven_rollout_and_step(runtime, policy, reward, prompts_path, gather: bool) -> list[int]:
    """Build the models, roll out 8 prompts of uneven lengths and take one optimizer step;
    the response widths of all ranks."""
    new_tokens = 1 if runtime.rank == 0 else 16
    tree = {
        "model": {"policy": policy, "reward": reward},
        "data": {"train": prompts_path},
        # Rank 1 may not emit EOS before 16 tokens, so it runs all 16 steps while rank 0
        # stops after 1.
        "generation": {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens},
        "ppo": {
            "rollout_batch_size": 8,
            "rollout_micro_batch_size": 4,
            "minibatch_size": 8,
            "micro_batch_size": 2,
        },
        "perf": {"gather_for_generation": gather},
    }
    cfg = config_from_dict(tree)
    plan = ppo_plan(cfg.ppo, runtime.world_size)
    built = build_models(cfg, runtime, plan, total_steps=1)
    tokenizer = load_tokenizer(policy)
    prompts = prompt_set(load_rows(prompts_path, "data.train")[:8], tokenizer, cfg.data)
    mine = list(range(8))[plan.rollout.rank_slice(runtime.rank)]

    def context():
        return runtime.generation_context(built.model, "actor", gather)

    models = RolloutModels(built.model, context, built.reference, built.scorer)
    batch, _ = collect_rollout(
        models, PromptBatch.of(prompts, mine, tokenizer.pad_token_id, runtime.device), cfg,
        tokenizer,
    )  # fmt: skip
    width = batch.response_ids.shape[1]
    widths = runtime.gather_objects([width])
    adv = torch.randn_like(batch.old_values)
    knobs = UpdateKnobs.from_config(cfg)
    minibatch_backward(runtime, built.model, batch, adv, adv, knobs, plan.update.micro_slices())
    trained = (built.model, built.optimizer, built.scheduler)
    step_and_schedule(runtime, trained, list(knobs.max_grad_norms))
    return widths


if __name__ == "__main__":
    main()
    sys.exit(end_process(0))  # gloo and interpreter exit: distributed/process_exit.py
