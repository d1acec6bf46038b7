"""The PPO recipe (docs/architecture.md section 5): prompts -> rollout -> scores ->
rewards -> advantages -> the update's view -> clipped updates -> statistics, one call per
step into this package and rlhf_dist/algo. The advantage estimator (ppo.estimator) makes
it PPO with GAE, GRPO, RLOO or REINFORCE++: the same iteration, with or without a
critic. On-policy distillation alone (`distill_iteration`: no task advantage) and online
DPO (online_dpo.py: pairs and the DPO loss) are objectives of their own on the same
rollout; `OBJECTIVES` maps their ppo.estimator values to the iteration each runs.

Up to four models: actor and critic (trained, one module, one optimizer with a param
group each; no critic for a critic-free estimator), reference (frozen SFT policy) and a
reward model or reward function (frozen).
Every statistic is a token or sequence SUM reduced over all ranks and divided once,
so logged means and the loss do not depend on how batches are split.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

from rlhf_dist.algo.rewards import token_kl
from rlhf_dist.checkpoint import maybe_fault, rng_state
from rlhf_dist.config import Config
from rlhf_dist.config.sizes import old_logprobs_from_update
from rlhf_dist.data.batching import PPOPlan
from rlhf_dist.distributed import Runtime
from rlhf_dist.errors import RewardFunctionError, ServerError
from rlhf_dist.generation import Sampler
from rlhf_dist.models import tokenizer_for
from rlhf_dist.models.vision import policy_vision
from rlhf_dist.observability.alerts import AlertMonitor
from rlhf_dist.observability.tracking import open_run, write_summary
from rlhf_dist.planning.start import planned_phases, run_hardware
from rlhf_dist.rewards.scoring import RewardTrainerState
from rlhf_dist.rollout import PromptBatch
from rlhf_dist.trainers.common import PreemptionFlag, evaluate_if_due, find_resume, safe_point
from rlhf_dist.trainers.ppo.advantages import (
    Advantages,
    estimate,
    no_task_advantages,
    rollout_rewards,
    trained_view,
    with_update_logprobs,
)
from rlhf_dist.trainers.ppo.controllers import Controllers
from rlhf_dist.trainers.ppo.entropy import cov_choice
from rlhf_dist.trainers.ppo.evaluation import held_out_eval
from rlhf_dist.trainers.ppo.online_dpo import online_dpo_iteration
from rlhf_dist.trainers.ppo.prompts import (
    extra_prompts,
    prompt_stream,
    training_prompts,
    with_ahead,
)
from rlhf_dist.trainers.ppo.rollout import (
    expect_next,
    normalized,
    print_first_batch,
    sample_rollout,
)
from rlhf_dist.trainers.ppo.setup import PPORun, export_models, start_ppo
from rlhf_dist.trainers.ppo.state import Progress, stop_on_failure, trainer_state
from rlhf_dist.trainers.ppo.stats import (
    IterationResult,
    PPOStats,
    iteration_result,
    report_iteration,
)
from rlhf_dist.trainers.ppo.update import UpdateKnobs, ppo_update
from rlhf_dist.trainers.publish import publish


class Iteration(Protocol):
    """One iteration of an objective (ppo_iteration and OBJECTIVES' entries): steps 2-8 on
    this rank's prompts with the controllers `ctl`, the statistics reduced over all ranks
    and the controllers of the next iteration (IterationResult.controllers)."""

    def __call__(
        self,
        runtime: Runtime,
        run: PPORun,
        ctl: Controllers,
        prompt_batch: PromptBatch,
        cfg: Config,
        it: int,
        more_prompts: Callable[[int], PromptBatch] | None = None,
        planned: dict[str, float] | None = None,
    ) -> IterationResult: ...


def train_ppo(cfg: Config, runtime: Runtime, sampler: Sampler | None = None) -> dict:
    """Run PPO (or another objective on its rollout, OBJECTIVES) as configured; returns
    the summary written to summary.json. `sampler`: what samples the rollouts (None:
    generation.backend's, rlhf_dist.generation.make_sampler)."""
    # 0. Start: data mistakes before any model loads, then the models (resumed if asked)
    ckpt, p, seed = find_resume(cfg, runtime), cfg.ppo, cfg.run.seed
    tokenizer = tokenizer_for(cfg, "policy")
    prompts = training_prompts(cfg, tokenizer, policy_vision(cfg, samples=True))
    run = start_ppo(cfg, runtime, ckpt, tokenizer, sampler)
    out, logger = open_run(cfg, runtime, "ppo", ckpt, p.iterations)
    runtime.print(prompts.report.summary("prompts"))
    start = run.first_iteration - 1
    runtime.seed_per_rank(seed)
    if ckpt:
        ckpt.restore_rng(seed)
    progress, preemption = Progress.resumed(ckpt), PreemptionFlag()
    ctl = Controllers.restored(p, ckpt)  # the iteration's state: KL, entropy, score moments
    alerts = AlertMonitor(cfg.alerts)  # ppo's alerts, their state resumed too
    if ckpt:  # alerts judge "since the start" of the run, not of this process
        alerts.load_state_dict(ckpt.trainer.get("alerts"))
    evaluate = held_out_eval(cfg, runtime, run)  # run.eval_every; None: no evaluation
    planned = planned_phases(cfg, "ppo", run_hardware(runtime))  # memory/planned_* metrics
    iteration: Iteration = OBJECTIVES.get(p.estimator, ppo_iteration)
    # 1. Prompts: this rank's share of each global batch, in a seed-determined order
    pad = run.tokenizer.pad_token_id
    overfit = cfg.debug.overfit_one_batch
    stream = prompt_stream(prompts, run.plan, runtime, seed, pad, start, overfit)
    for it, (prompt_batch, ahead) in zip(
        range(start + 1, p.iterations + 1), with_ahead(stream, max(p.max_staleness, 1))
    ):
        rng = rng_state()  # as the checkpoint of iteration it - 1 holds it
        expect_next(cfg, run, it, ahead)  # ppo.max_staleness: what to request ahead
        more = extra_prompts(prompts, run.plan, runtime, seed, pad, it)
        # 2.-7. Rollout, scores, rewards, advantages, the update's view, the update
        run.scorer.trainer_state = reward_trainer_state(
            run.plan, it, len(prompts.ids), p.iterations
        )
        try:
            result = iteration(runtime, run, ctl, prompt_batch, cfg, it, more, planned)
        except (RewardFunctionError, ServerError) as e:
            run.rollout_models.sampler.close()  # a rollout in flight is not waited for
            state = trainer_state(run, ctl, progress.first_score, alerts)
            failure = stop_on_failure(cfg, runtime, (out, logger), run, (it - 1, rng), state, e)
            raise failure from e.__cause__
        # 8. Statistics and the next iteration's controllers, then the safe point
        progress, ctl = progress.after(result.stats), result.controllers
        report_iteration(logger, cfg, it, result, alerts)
        steps, trained = (it, p.iterations), (run.model, run.optimizer)
        state = trainer_state(run, ctl, progress.first_score, alerts)
        safe_point(cfg, runtime, out, steps, preemption, trained, state)
        evaluate_if_due(cfg, runtime, logger, steps, evaluate)
    # 9. Export the trained models, the summary and the model card
    export_models(cfg, runtime, run.model, run.tokenizer, out)
    summary = run_summary(cfg, progress)
    write_summary(runtime, out, summary)
    logger.close()
    publish(cfg, runtime, out, "ppo", summary)
    return summary


def ppo_iteration(
    runtime: Runtime,
    run: PPORun,
    ctl: Controllers,
    prompt_batch: PromptBatch,
    cfg: Config,
    it: int,
    more_prompts: Callable[[int], PromptBatch] | None = None,
    planned: dict[str, float] | None = None,
    advantages_of: Callable[..., Advantages] = estimate,
) -> IterationResult:
    """One PPO iteration, steps 2-8 of docs/architecture.md section 5, on this rank's
    prompts (B rows: prompts x n). The rollout batch is frozen: each step makes a new one.
    more_prompts: round -> prompt batch (dynamic sampling); planned: the memory plan's
    per-phase peaks, bytes; advantages_of: step 5 (advantages.estimate: the registered
    estimator ppo.estimator)."""
    p, kl_coef = cfg.ppo, ctl.kl.coef
    t0 = time.time()
    # 2. Rollout: sample and score (old/ref log-probs, values; none of the actor's when
    #    the update's forward gives them), refilled with ppo.dynamic_sampling
    run.model.eval()
    runtime.start_phase_peak()
    rollout = sample_rollout(
        runtime, run, prompt_batch, cfg, more_prompts, not old_logprobs_from_update(cfg)
    )
    measured = {"rollout": runtime.phase_peak_bytes()}
    runtime.start_phase_peak()
    maybe_fault("rollout", it)
    run.scorer.raise_failure(runtime)  # all ranks together, weights untouched
    print_first_batch(runtime, run, cfg, rollout, it)
    t1 = time.time()
    # 3. Scores: running normalisation and clipping, (B,)
    batch, ctl = normalized(runtime, ctl, rollout.batch, cfg)
    # 4. Rewards (B, T); kl (B, T) is None while the old log-probs are unknown
    rewards, kl = rollout_rewards(batch, kl_coef, p)
    # 5. Advantages (B, T) of the registered estimator; returns (B, T) with a critic
    advantages, returns = advantages_of(p.estimator, batch, rewards, run.plan.samples_per_prompt, p)
    # 6. The update's view: overlong mask, whitening, the tokens cov_control acts on
    trained, trained_adv, overlong = trained_view(runtime, batch, advantages, cfg)
    chosen, cov_stats = cov_choice(runtime, trained, trained_adv, p, cfg.run.seed, it)
    # 7. Update: ppo_epochs x minibatches of the registered policy loss and its terms
    run.model.train()
    knobs = UpdateKnobs.from_config(cfg, kl_coef, run.group_names, ctl.entropy.coef)
    update = ppo_update(runtime, run, trained, trained_adv, returns, knobs, it, chosen)
    measured["update"] = runtime.phase_peak_bytes()
    batch = with_update_logprobs(batch, update)
    if kl is None:  # the update's forward gave the old log-probs: the rollout's KL now
        kl = token_kl(batch.old_logprobs, batch.ref_logprobs, batch.response_mask, p.kl_kind)
    # 8. Statistics over all ranks, then the next iteration's KL and entropy coefficients
    phases = PPOStats(rollout, batch, kl, advantages, returns, overlong | cov_stats, update)
    result = iteration_result(
        runtime, run, ctl, cfg, it, phases, (t0, t1, time.time()), planned, measured
    )
    stats = result.stats
    ctl = ctl.after(stats["objective/kl"], stats["objective/entropy"], run.plan.sequences)
    return dataclasses.replace(result, controllers=ctl)


def reward_trainer_state(
    plan: PPOPlan, it: int, num_prompts: int, iterations: int
) -> RewardTrainerState:
    """What a reward reads as TRL's `trainer_state` during iteration `it` (1-based): the
    optimizer steps and the passes over the `num_prompts` training prompts done before
    it, and the run's optimizer steps in all (`iterations` of the plan's steps each)."""
    steps = plan.optimizer_steps_per_iteration
    done = (it - 1) * plan.rollout.global_size / num_prompts
    return RewardTrainerState((it - 1) * steps, done, iterations * steps)


def run_summary(cfg: Config, progress: Progress) -> dict:
    """summary.json: the iterations, the last score and KL, the first score, episodes."""
    p, stats = cfg.ppo, progress.stats or {}
    return {
        "iterations": p.iterations,
        "score": stats.get("objective/score"),
        "kl": stats.get("objective/kl"),
        "first_score": progress.first_score,
        "episodes": p.iterations * p.rollout_batch_size,
    }


def distill_iteration(
    runtime: Runtime,
    run: PPORun,
    ctl: Controllers,
    prompt_batch: PromptBatch,
    cfg: Config,
    it: int,
    more_prompts: Callable[[int], PromptBatch] | None = None,
    planned: dict[str, float] | None = None,
) -> IterationResult:
    """One iteration of on-policy distillation alone (ppo.estimator=distill,
    docs/distill.md): PPO's iteration with no task advantage (step 5), the teacher's
    per-token signal joining the advantages or the loss in the update (step 7)."""
    no_task = no_task_advantages
    args = (prompt_batch, cfg, it, more_prompts, planned)
    return ppo_iteration(runtime, run, ctl, *args, no_task)


# The objectives of their own, by their ppo.estimator value (catalog.OBJECTIVES); every
# other value names an advantage estimator of PPO's iteration (catalog.ADVANTAGE_ESTIMATORS).
OBJECTIVES: dict[str, Iteration] = {
    "distill": distill_iteration,
    "online_dpo": online_dpo_iteration,
}
