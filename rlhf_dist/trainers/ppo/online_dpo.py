"""Online DPO's pairs and update (ppo.estimator=online_dpo, docs/online_dpo.md).

Guo et al. 2024 ("Direct Language Model Alignment from Online AI Feedback"): every
iteration the CURRENT policy samples n >= 2 responses per prompt (the rollout of
rollout.py, groups of n adjacent rows on one rank), the labeller scores them (the
run's scorer: reward model, reward functions or judge), the best and the worst form a
(chosen, rejected) pair (algo.preference.best_worst_pairs; a tied group has none and is
skipped), and the DPO loss (sigmoid or IPO, algo.preference.dpo_terms) with beta =
ppo.kl_coef trains the policy on the pairs against the reference.

Log-probabilities are those of the sampling distribution (logits / generation.temperature)
for the policy AND the reference, as everywhere in the RL loop (the rollout's reference
log-probs are reused, no second reference pass); TRL's OnlineDPOTrainer uses temperature 1.

Split invariance (docs/architecture.md section 4): every rank holds the same number of
groups, so the same number of pairs, tied or not; a tied pair weighs 0, and each
micro-batch's weighted pair-loss SUM is divided by the count of untied pairs in the WHOLE
global minibatch. A step's gradient therefore does not depend on how its pairs are cut into
ranks and micro-batches, and every rank runs the same number of forwards (ZeRO-3).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf_dist.algo.preference import best_worst_pairs, dpo_terms, pair_labels, sequence_logprobs
from rlhf_dist.algo.rewards import token_kl
from rlhf_dist.checkpoint import maybe_fault
from rlhf_dist.config import Config
from rlhf_dist.distributed import Runtime
from rlhf_dist.rollout import PromptBatch, RolloutBatch
from rlhf_dist.stats import StatSums
from rlhf_dist.trainers.common import padding_cells, share_of_global_mean, step_and_schedule
from rlhf_dist.trainers.ppo.controllers import Controllers
from rlhf_dist.trainers.ppo.rollout import normalized, print_first_batch, sample_rollout
from rlhf_dist.trainers.ppo.setup import PPORun
from rlhf_dist.trainers.ppo.stats import (
    IterationResult,
    due,
    gather_distributions,
    iteration_costs,
    overlong_stats,
    rollout_stats,
    sample_rows,
)


@dataclass(frozen=True)
class Pairs:
    """One rank's pairs, one per group of its rollout: chosen and rejected row indices
    into the rollout (G,) long, and valid (G,) bool, False for a tied group (skipped)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, scores: torch.Tensor, group_size: int) -> Pairs:
        """The best against the worst sample of each group of the rollout's scores (B,)."""
        return cls(*best_worst_pairs(scores, group_size))

    def select(self, index: slice | torch.Tensor) -> Pairs:
        """The pairs at `index` (a slice or (m,) indices), a new Pairs."""
        return Pairs(self.chosen[index], self.rejected[index], self.valid[index])


@dataclass(frozen=True)
class PairKnobs:
    """What the online DPO update reads: DPO's beta (ppo.kl_coef), the loss (ppo.dpo_loss),
    the sampling temperature of every log-prob, and the actor's gradient-norm limit."""

    beta: float
    loss_type: str
    temperature: float
    max_grad_norm: float

    @classmethod
    def from_config(cls, cfg: Config) -> PairKnobs:
        p = cfg.ppo
        return cls(p.kl_coef, p.dpo_loss, cfg.generation.temperature, p.optim.max_grad_norm)


def pair_statistics(runtime: Runtime, batch: RolloutBatch, pairs: Pairs) -> dict[str, float]:
    """What the labeller decided, over all ranks: online_dpo/pairs (untied pairs),
    online_dpo/tie_fraction (share of groups skipped as ties), and the labeller's mean score
    of the chosen and rejected responses and their margin, over the untied pairs."""
    s, w = StatSums(), pairs.valid.to(batch.scores.dtype)
    n, groups = w.sum(), pairs.valid.numel()
    chosen, rejected = batch.scores[pairs.chosen], batch.scores[pairs.rejected]
    s.add("online_dpo/tie_fraction", groups - n, groups)
    s.add("online_dpo/score_chosen", (w * chosen).sum(), n)
    s.add("online_dpo/score_rejected", (w * rejected).sum(), n)
    s.add("online_dpo/score_margin", (w * (chosen - rejected)).sum(), n)
    return s.reduce(runtime) | {"online_dpo/pairs": float(runtime.all_sum(n.double()))}


def pair_loss(
    model: torch.nn.Module, batch: RolloutBatch, pairs: Pairs, knobs: PairKnobs
) -> tuple[torch.Tensor, StatSums]:
    """(the weighted SUM of the DPO losses of m pairs (tied ones weigh 0), from ONE forward
    of their 2m responses (chosen rows, then rejected rows); the pair statistics, sums
    over the untied pairs). The reference log-probs are the rollout's."""
    stats, rows = StatSums(), torch.cat([pairs.chosen, pairs.rejected])
    mb, _ = batch.select(rows).trimmed()  # columns that are padding in every row cost nothing
    stats.add("update/pad_fraction", *padding_cells(mb.attention_mask))
    logprobs, *_ = model(
        mb.input_ids, mb.attention_mask, mb.response_mask, knobs.temperature,
        media=mb.pixel_inputs(),  # a vision run's images of these rows
    )  # fmt: skip
    assert mb.ref_logprobs is not None, "online DPO's rollout is scored by the reference"
    policy = sequence_logprobs(logprobs, mb.response_mask)  # (2m,) log pi(y | x)
    ref = sequence_logprobs(mb.ref_logprobs, mb.response_mask)
    m = pairs.chosen.numel()
    terms = dpo_terms(policy[:m], policy[m:], ref[:m], ref[m:], knobs.beta, knobs.loss_type)
    w = pairs.valid.to(terms["loss"].dtype)
    n = w.sum()
    chosen, rejected = terms["chosen_rewards"], terms["rejected_rewards"]
    stats.add("dpo/loss", (w * terms["loss"].detach()).sum(), n)
    stats.add("rewards/chosen", (w * chosen).sum(), n)
    stats.add("rewards/rejected", (w * rejected).sum(), n)
    stats.add("rewards/margins", (w * (chosen - rejected)).sum(), n)
    stats.add("rewards/accuracy", (w * (chosen > rejected).to(w.dtype)).sum(), n)
    stats.add("logprobs/chosen", (w * policy[:m].detach()).sum(), n)
    stats.add("logprobs/rejected", (w * policy[m:].detach()).sum(), n)
    return (w * terms["loss"]).sum(), stats


def pair_step(
    runtime: Runtime, model: torch.nn.Module, batch: RolloutBatch, pairs: Pairs, per_micro: int,
    knobs: PairKnobs,
) -> StatSums | None:  # fmt: skip
    """Accumulate one optimizer step's gradient over this rank's `pairs` (its share of the
    global minibatch) in micro-batches of `per_micro` pairs; returns the micro-batches'
    statistics joined in order. None, with no backward, when the whole global minibatch
    has no untied pair (every rank agrees)."""
    count = runtime.all_sum(pairs.valid.sum().to(torch.float32))
    if float(count) == 0:
        return None
    starts, parts = range(0, pairs.valid.numel(), per_micro), []
    for i, start in enumerate(starts):
        part = pairs.select(slice(start, start + per_micro))
        loss_sum, stats = pair_loss(model, batch, part, knobs)
        loss = share_of_global_mean(runtime, loss_sum, count)
        runtime.micro_backward(model, loss, last=i == len(starts) - 1)
        parts.append(stats)
    return StatSums.joined(parts)


def online_dpo_update(
    runtime: Runtime, run: PPORun, batch: RolloutBatch, pairs: Pairs, knobs: PairKnobs,
    it: int = 0,
) -> dict[str, float]:  # fmt: skip
    """ppo_epochs passes over this rank's G pairs in a fresh order each, one optimizer step
    per minibatch of ppo.minibatch_size / n pairs over all ranks (a group of n sequences is
    one pair), micro-batches of ppo.micro_batch_size / 2 pairs (2 responses each) per
    forward. A minibatch whose pairs all tie takes no optimizer or schedule step (a zero
    gradient would still move Adam's weights through its moments); they are counted as
    online_dpo/empty_steps. Returns the reduced statistics."""
    plan, parts = run.plan, []  # parts: each step's StatSums, in order
    per_step = plan.update.per_rank // plan.samples_per_prompt  # pairs per rank per step
    per_micro = max(1, plan.update.micro_batch_size // 2)
    trained, G = (run.model, run.optimizer, run.scheduler), pairs.valid.numel()
    empty = 0
    with runtime.training_weights(run.model, run.gather_for_training, "actor-critic"):
        for _ in range(plan.ppo_epochs):
            order = torch.randperm(G, device=pairs.valid.device)
            for start in range(0, G, per_step):
                part = pairs.select(order[start : start + per_step])
                stats = pair_step(runtime, run.model, batch, part, per_micro, knobs)
                if stats is None:
                    empty += 1
                    continue
                norms = step_and_schedule(runtime, trained, [knobs.max_grad_norm])
                for norm in norms or ():
                    stats.add("optim/grad_norm_actor", norm, 1)
                parts.append(stats)
                maybe_fault("update", it)
    reduced = StatSums.joined(parts).reduce(runtime)
    return reduced | {"online_dpo/empty_steps": float(empty)}


def online_dpo_iteration(
    runtime: Runtime,
    run: PPORun,
    ctl: Controllers,
    prompt_batch: PromptBatch,
    cfg: Config,
    it: int,
    more_prompts: Callable[[int], PromptBatch] | None = None,
    planned: dict[str, float] | None = None,
) -> IterationResult:
    """One iteration of online DPO (docs/online_dpo.md) on PPO's rollout: steps 2-3 and 8
    of docs/architecture.md section 5, pairs and the DPO update in place of 4-7. The
    per-token "advantages" logged are the pair labels (+1 / -1 / 0), (B, T). ctl: the
    controllers, of which only the score moments move here; planned: not read (online DPO
    reports no memory plan)."""
    t0 = time.time()
    # 2. Rollout: n samples per prompt by the current policy, old and reference log-probs
    run.model.eval()
    rollout = sample_rollout(runtime, run, prompt_batch, cfg, more_prompts)
    maybe_fault("rollout", it)
    run.scorer.raise_failure(runtime)  # all ranks together, weights untouched
    print_first_batch(runtime, run, cfg, rollout, it)
    t1 = time.time()
    # 3. Scores: running normalisation and clipping, (B,)
    batch, ctl = normalized(runtime, ctl, rollout.batch, cfg)
    # 4. Pairs: each group's best and worst sample (tied groups skipped), and their labels
    n, mask = run.plan.samples_per_prompt, batch.response_mask
    labels = pair_labels(batch.scores, n, mask)  # (B, T): +1 chosen, -1 rejected, 0 else
    pairs = Pairs.of(batch.scores, n)
    # 5. Update: the DPO loss on the pairs against the rollout's reference log-probs
    run.model.train()
    update = online_dpo_update(runtime, run, batch, pairs, PairKnobs.from_config(cfg), it)
    # 6. Statistics over all ranks: the rollout's, the labeller's, the update's
    kl = token_kl(batch.old_logprobs, batch.ref_logprobs, mask, cfg.ppo.kl_kind)
    stats = rollout_stats(runtime, batch, kl, labels, None, ctl.kl.coef)
    stats |= rollout.sampling_stats | update
    stats |= pair_statistics(runtime, batch, pairs) | run.scorer.component_stats(runtime)
    stats |= overlong_stats(runtime, batch, mask, cfg)  # the soft penalty, in the scores
    distributions = None
    if due(cfg.run.histogram_every, it):  # a collective: every rank takes part
        distributions = gather_distributions(runtime, batch, labels, kl)
    stats |= iteration_costs(runtime, run, ctl, (t0, t1, time.time()), rollout.seconds, mask, cfg)
    extra = run.scorer.take_extra_columns(rollout.prompt_texts, rollout.texts)  # log_extra's
    samples = sample_rows(
        rollout.prompt_texts, rollout.texts, batch, kl, extra, rollout.prompt_index
    )
    return IterationResult(stats, distributions, samples[: cfg.run.num_samples], ctl)
