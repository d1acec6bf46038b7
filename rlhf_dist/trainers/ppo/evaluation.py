"""PPO's evaluation during training (run.eval_every, trainers/common.evaluate_if_due): the
actor measured on held-out prompts the way `rlhf-dist eval` measures a policy."""

from __future__ import annotations

from collections.abc import Callable

from rlhf_dist.config import Config
from rlhf_dist.data.rows import load_data, prompt_set
from rlhf_dist.distributed import Runtime
from rlhf_dist.evaluate import evaluate_policy, load_gold_function
from rlhf_dist.models.vision import policy_vision
from rlhf_dist.trainers.ppo.setup import PPORun


def held_out_eval(
    cfg: Config, runtime: Runtime, run: PPORun
) -> Callable[[], dict[str, float]] | None:
    """evaluate() -> {name: number} of the actor of `run` (the PPORun) on data.eval's
    prompts, or None without run.eval_every or data.eval.

    `rlhf-dist eval`'s measurement (evaluate.evaluate_policy): score (the raw reward with
    reward.missing_eos_penalty; no normalisation or clipping), KL to the reference,
    length, EOS rate, gold reward with eval.gold_function and a reward model's length
    bias, on at most eval.num_prompts prompts in chunks of eval.batch_size. It samples
    with generation.* through the rollout's own models (the actor gathered or kept in step
    as for a rollout under ZeRO-3, or vLLM), every rank its share in lock-step. The reward
    components' sums it adds are drained into eval/score_<name>, so the next iteration
    reports its own."""
    if not (cfg.run.eval_every and cfg.data.eval):
        return None
    d = cfg.data
    rows = load_data(d, "eval")
    vision = policy_vision(cfg, samples=True)  # a vision policy's held-out prompts
    prompts = prompt_set(rows, run.tokenizer, d, f"data.eval {d.eval!r}", vision)
    runtime.print(prompts.report.summary("eval prompts"))
    gold_fn = load_gold_function(cfg.eval.gold_function) if cfg.eval.gold_function else None
    models = run.rollout_models

    def evaluate() -> dict[str, float]:
        run.model.eval()  # as for a rollout; the next iteration sets the modes it needs
        with runtime.autocast():
            summary, _ = evaluate_policy(runtime, models, prompts, cfg, run.tokenizer, gold_fn)
        components = run.scorer.component_stats(runtime)  # a collective, as in the loop
        # evaluate_policy counts the rows no reward applied to itself (skipped_rows)
        components.pop("reward/skipped_rows", None)
        return summary | {k.removeprefix("objective/"): v for k, v in components.items()}

    return evaluate
