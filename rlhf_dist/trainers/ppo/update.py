"""The PPO update (docs/architecture.md section 5, step 8): ppo_epochs passes over this
rank's rollout in minibatches, one optimizer step per minibatch, each accumulated over
micro-batches whose loss SUMS are divided by the global minibatch's count, so the step's
gradient does not depend on how the minibatch is cut (section 4, split invariance).

With one optimizer step per rollout (`old_logprobs_from_update`) the rollout comes
without old log-probs: the update's own forward gives them (detached: ratio exactly 1),
and `ppo_update` returns them with the statistics; the batch is never written to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch

from rlhf_dist.algo.distill import distill_advantages, generalized_jsd
from rlhf_dist.algo.entropy import clip_cov_loss, kl_cov_penalty
from rlhf_dist.algo.kl import kl_estimate
from rlhf_dist.algo.losses import (
    aggregation_count,
    aggregation_weights,
    value_terms,
)
from rlhf_dist.algo.masking import masked_sum
from rlhf_dist.algo.objectives import sequence_log_ratio
from rlhf_dist.algo.policy_losses import POLICY_LOSSES, PolicyLossInputs, decoupled_policy_terms
from rlhf_dist.algo.rollout_correction import behaviour_weights, rollout_correction_weights
from rlhf_dist.checkpoint import maybe_fault
from rlhf_dist.config import Config, PerfConfig
from rlhf_dist.data.batching import BatchPlan, token_budget_split
from rlhf_dist.distributed import Runtime
from rlhf_dist.engine.forward import chunked_divergence, teacher_states
from rlhf_dist.models.routing import replaying
from rlhf_dist.rollout import RolloutBatch
from rlhf_dist.stats import StatSums
from rlhf_dist.trainers.common import padding_cells, share_of_global_mean, step_and_schedule
from rlhf_dist.trainers.moe_aux import StepRouting, recording, step_routing, trained_router_aux
from rlhf_dist.trainers.ppo.ptx import PtxStream
from rlhf_dist.trainers.ppo.setup import PPORun

# (micro-batch rows, as an index into the minibatch; log-probs and entropies (b, T') of
# the update's forward, detached) for a micro-batch whose rollout had no old log-probs
FirstForward = tuple[slice | torch.Tensor, torch.Tensor, torch.Tensor]
# A micro-batch of a minibatch share: rows as a slice, or an index tensor (b,) with
# ppo.micro_batch_tokens (update_micro_batches)
MicroSlice: TypeAlias = slice | torch.Tensor
# The per-token divergence the actor's forward applies to its final hidden states:
# (LM head, hidden (N, H)) -> (N,) (ActorCritic.forward's `divergence`)
Divergence: TypeAlias = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class UpdateKnobs:
    """The numbers a PPO update reads: loss knobs (ppo.*), the sampling temperature the
    new log-probs must use, the KL coefficient when KL is a loss term (0 when it is a
    reward penalty), and one gradient-norm limit per optimizer param group."""

    temperature: float
    clip_eps_low: float | None  # ppo.clip_eps_low, else ppo.clip_eps; None: clipping off
    clip_eps_high: float | None  # ppo.clip_eps_high, else ppo.clip_eps
    dual_clip: float | None
    value_clip_eps: float | None
    vf_coef: float
    entropy_coef: float
    kl_loss_coef: float
    kl_kind: str
    loss_aggregation: str
    max_grad_norms: tuple[float, ...]
    # ppo.rollout_correction against the sampler's log-probs (vLLM, rollout servers):
    # (method, level, low, high); method "none": off
    rollout_correction: tuple[str, str, float, float] = ("none", "token", 0.5, 2.0)
    decoupled: bool = False  # ppo.decoupled: AReaL's objective, the correction its weight
    ratio_level: str = "token"  # token (PPO) or sequence (GSPO)
    policy_loss: str = "clip"  # clip (PPO) or cispo
    cov_control: str = "none"  # ppo.cov_control: what the chosen tokens get (entropy.py)
    cov_kl_coef: float = 1.0  # kl_cov: weight of |log pi - log pi_old| on the chosen tokens
    distill_coef: float = 0.0  # weight of the teacher's signal; 0: no model.teacher
    distill_loss: str = "reverse_kl"  # ppo.distill_loss: reverse_kl (an advantage) or gjsd
    distill_beta: float = 0.5  # ppo.distill_beta, GKD's beta of gjsd
    # model.router_aux_loss_coef: a mixture-of-experts actor's load-balancing loss
    # (trainers/moe_aux.py); None: the model config's value
    router_aux_loss_coef: float | None = None

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        kl_coef: float | None = None,
        group_names: tuple[str, ...] = ("actor", "critic"),
        entropy_coef: float | None = None,
    ) -> UpdateKnobs:
        """kl_coef, entropy_coef: the controllers' current values (None: ppo.kl_coef,
        ppo.entropy_coef)."""
        p = cfg.ppo
        kl_coef = p.kl_coef if kl_coef is None else kl_coef
        entropy_coef = p.entropy_coef if entropy_coef is None else entropy_coef
        low = p.clip_eps if p.clip_eps_low is None else p.clip_eps_low
        high = p.clip_eps if p.clip_eps_high is None else p.clip_eps_high
        kl_loss_coef = kl_coef if p.kl_placement == "loss" else 0.0
        optim = {"actor": p.optim, "critic": p.critic_optim}  # param group -> its section
        norms = tuple(optim[name].max_grad_norm for name in group_names)
        return cls(
            cfg.generation.temperature, low, high, p.dual_clip, p.value_clip_eps, p.vf_coef,
            entropy_coef, kl_loss_coef, p.kl_kind, p.loss_aggregation, norms,
            rollout_correction=(p.rollout_correction, p.rollout_correction_level,
                                p.rollout_correction_low, p.rollout_correction_high),
            decoupled=p.decoupled,
            ratio_level=p.ratio_level, policy_loss=p.policy_loss, cov_control=p.cov_control,
            cov_kl_coef=p.cov_kl_coef,
            distill_coef=p.distill_coef if cfg.model.teacher else 0.0,
            distill_loss=p.distill_loss, distill_beta=p.distill_beta,
            router_aux_loss_coef=cfg.model.router_aux_loss_coef,
        )  # fmt: skip


@dataclass(frozen=True)
class UpdateResult:
    """What an update gives back: its statistics, reduced over ranks, and, when the
    rollout came without old log-probs, the old log-probs and entropies (B, T) its first
    forward computed (0 outside the rows' response tokens)."""

    stats: dict[str, float]
    old_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass(frozen=True)
class MicroLoss:
    """One micro-batch's loss and what it gives back (micro_batch_loss)."""

    loss_sum: torch.Tensor  # weighted token SUM, 0-d; divided by the global count later
    fresh: tuple[torch.Tensor, torch.Tensor] | None  # (log-probs, entropies) (b, T'), or None
    stats: StatSums  # the loss terms' token sums with their counts


@dataclass(frozen=True)
class Backward:
    """One optimizer step's accumulated backward (minibatch_backward): the old log-probs
    and entropies of micro-batches that had none, and the step's statistics."""

    first_forwards: list[FirstForward]
    stats: StatSums


def policy_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    knobs: UpdateKnobs,
    behaviour: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token policy terms (B, T) of the registered knobs.policy_loss
    (algo/policy_losses.py) with knobs.ratio_level's ratio (token; sequence: GSPO's, from
    each row's own tokens, which a micro-batch always holds whole); with `behaviour` (B, T),
    ppo.decoupled's weights pi_old / pi_behav, the decoupled objective of that loss."""
    log_ratio = None
    if knobs.ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logprobs, old_logprobs, response_mask)
    inputs = PolicyLossInputs(
        logprobs, old_logprobs, advantages, log_ratio, knobs.clip_eps_low, knobs.clip_eps_high,
        knobs.dual_clip,
    )  # fmt: skip
    if behaviour is not None:  # old_logprobs: the proximal policy, before this update
        return decoupled_policy_terms(knobs.policy_loss, inputs, behaviour)
    return POLICY_LOSSES[knobs.policy_loss].fn(inputs)  # ppo.policy_loss, validated by config


def micro_batch_loss(
    model: torch.nn.Module, mb: RolloutBatch, advantages: torch.Tensor,
    returns: torch.Tensor | None, knobs: UpdateKnobs,
    chosen: torch.Tensor | None = None,
    teacher: Teacher | None = None,
) -> MicroLoss:  # fmt: skip
    """One micro-batch's MicroLoss: the weighted token SUM of its loss, this forward's
    detached (log-probs, entropies) when mb has no old log-probs, and the loss terms'
    statistics (token sums with their counts). The caller divides the sum by the
    global count of tokens or sequences (knobs.loss_aggregation). The loss: the policy
    loss, + vf_coef x the value loss with a critic, + kl_loss_coef x the KL to the
    reference when KL is a loss term, - entropy_coef x the entropy. On-policy distillation
    (knobs.distill_coef > 0, docs/distill.md): distill_coef x the teacher's per-token
    log-ratio joins the advantages (distill_loss=reverse_kl), or distill_coef x GJSD to
    the teacher (`teacher`, run on this micro-batch) joins the loss (gjsd).

    mb: a RolloutBatch (B rows, T response columns); advantages: (B, T); returns: (B, T)
    or None without a critic; chosen: (B, T)
    bool, the tokens ppo.cov_control acts on (None: off). Without old log-probs
    (`old_logprobs_from_update`) this forward's, detached, are the old ones."""
    first, stats = mb.old_logprobs is None, StatSums()  # this micro-batch's statistics
    gjsd = gjsd_of_teacher(teacher, mb, knobs) if knobs.distill_coef else None
    # ppo.routing_replay: the rollout's recorded routing forced (models/routing.py)
    replay = {} if mb.routing is None else {"routing": replaying([mb.routing])}
    logprobs, entropy, values, *divergence = model(
        mb.input_ids, mb.attention_mask, mb.response_mask, knobs.temperature,
        bool(knobs.entropy_coef) or first, divergence=gjsd, media=mb.pixel_inputs(), **replay,
    )  # fmt: skip
    old_logprobs = logprobs.detach() if first else mb.old_logprobs
    if replay:  # tokens the update's own routing would have sent elsewhere (docs/moe.md)
        stats.add("router/update_flip_rate", *replay["routing"].flips(mb.response_mask))
    mask, n = mb.response_mask, mb.response_mask.sum()
    advantages = with_teacher_advantages(advantages, old_logprobs, mb, knobs)
    behaviour = correction_weights(old_logprobs, mb, knobs, stats) if knobs.decoupled else None
    pg = policy_terms(logprobs, old_logprobs, mask, advantages, knobs, behaviour)
    per_token = pg["loss"]
    if chosen is not None:
        per_token = cov_control_terms(per_token, logprobs, old_logprobs, chosen, knobs, stats, mask)
    if divergence:  # gjsd: a loss term of its own, gradients through the actor's head
        per_token = per_token + knobs.distill_coef * divergence[0]
        stats.add("distill/gjsd", masked_sum(divergence[0].detach(), mask), n)
    if knobs.rollout_correction[0] != "none" and not knobs.decoupled:  # pi_rollout, not pi_old
        per_token = correction_weights(old_logprobs, mb, knobs, stats) * per_token
    named = [("policy", per_token, pg["clipped"])]
    if values is not None:
        vf = value_terms(values, mb.old_values, returns, knobs.value_clip_eps)
        per_token = per_token + knobs.vf_coef * vf["loss"]
        named.append(("value", vf["loss"], vf["clipped"]))
    if knobs.kl_loss_coef:
        kl = kl_estimate(logprobs, mb.ref_logprobs, knobs.kl_kind)
        per_token = per_token + knobs.kl_loss_coef * kl
        stats.add("policy/kl_loss", masked_sum(kl.detach(), mask), n)
    if knobs.entropy_coef:
        per_token = per_token - knobs.entropy_coef * entropy
        stats.add("policy/entropy", masked_sum(entropy.detach(), mask), n)
    add_loss_stats(stats, named, pg, mask)
    weights = aggregation_weights(mask, knobs.loss_aggregation, per_token.dtype)
    fresh = (old_logprobs, entropy.detach()) if first else None
    return MicroLoss(masked_sum(weights * per_token, mask), fresh, stats)


def correction_weights(
    old_logprobs: torch.Tensor, mb: RolloutBatch, knobs: UpdateKnobs, stats: StatSums
) -> torch.Tensor:
    """Each token's weight (B, T) for the sampler's log-probs (the rollout's
    `sampler_logprobs`): ppo.rollout_correction's bounded ratio pi_old / pi_rollout
    (algo/rollout_correction.py), or with ppo.decoupled and no correction the raw one
    (AReaL's behaviour weight). The share of tokens whose weight was capped or masked goes
    to `stats` as a token mean (the train-vs-rollout KL is rollout/sampler_kl, stats.py)."""
    method, level, low, high = knobs.rollout_correction
    mask, n = mb.response_mask, mb.response_mask.sum()
    assert mb.sampler_logprobs is not None, "a correction without the sampler's log-probs"
    if method == "none":
        return behaviour_weights(old_logprobs, mb.sampler_logprobs, mask)
    weights, corrected = rollout_correction_weights(
        old_logprobs, mb.sampler_logprobs, mask, method, level, low, high
    )
    stats.add("rollout/corrected_frac", masked_sum(corrected.float(), mask), n)
    return weights


def cov_control_terms(
    per_token: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    chosen: torch.Tensor,
    knobs: UpdateKnobs,
    stats: StatSums,
    mask: torch.Tensor,
) -> torch.Tensor:
    """The per-token policy loss (B, T) with ppo.cov_control applied to the `chosen` tokens
    (B, T) bool, picked once per rollout (entropy.py): clip_cov stops their
    gradient; kl_cov adds cov_kl_coef x |log pi - log pi_old| to them (its token sum is
    logged as entropy/kl_cov_loss, a mean over all trained tokens like policy/kl_loss)."""
    if knobs.cov_control == "clip_cov":
        return clip_cov_loss(per_token, chosen)
    penalty = kl_cov_penalty(logprobs, old_logprobs, chosen, knobs.cov_kl_coef)
    stats.add("entropy/kl_cov_loss", masked_sum(penalty.detach(), mask), mask.sum())
    return per_token + penalty


def with_teacher_advantages(
    advantages: torch.Tensor, old_logprobs: torch.Tensor, mb: RolloutBatch, knobs: UpdateKnobs
) -> torch.Tensor:
    """The advantages (B, T) + distill_coef x the teacher's per-token log-ratio of the
    sampled tokens (distill.distill_advantages; distill_loss=reverse_kl), else as given.
    Added here, after the trainer's whitening, with the old log-probs of this forward
    when the rollout had none (old_logprobs_from_update)."""
    if not knobs.distill_coef or knobs.distill_loss != "reverse_kl":
        return advantages
    assert mb.teacher_logprobs is not None, "the rollout was scored by the teacher"
    signal = distill_advantages(old_logprobs, mb.teacher_logprobs, mb.response_mask)
    return advantages + knobs.distill_coef * signal


@dataclass(frozen=True)
class Teacher:
    """What the update's GJSD reads of the frozen teacher: the model (prepared as frozen)
    and the speed paths of its forward (the rollout's perf)."""

    model: torch.nn.Module
    perf: PerfConfig


def gjsd_of_teacher(
    teacher: Teacher | None, mb: RolloutBatch, knobs: UpdateKnobs
) -> Divergence | None:
    """With distill_loss=gjsd: the divergence function the actor's forward applies to its
    final hidden states (ActorCritic.forward's `divergence`): per-token GJSD(distill_beta)
    to the teacher at the sampling temperature, over the whole vocabulary, chunked
    (engine.forward.chunked_divergence), after one teacher forward of micro-batch `mb`
    (every rank runs one per micro-batch: a collective under ZeRO-3). None otherwise."""
    if knobs.distill_loss != "gjsd":
        return None
    assert teacher is not None, "gjsd needs the teacher in the update"
    P = mb.prompt_ids.shape[1]
    states = teacher_states(
        teacher.model, mb.input_ids, mb.attention_mask, mb.response_mask, P, teacher.perf
    )
    jsd = functools.partial(generalized_jsd, beta=knobs.distill_beta, temperature=knobs.temperature)
    chunk = teacher.perf.logprob_chunk_tokens

    def divergence(lm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N,)
        return chunked_divergence(lm, hidden, states, jsd, chunk)

    return divergence


def add_loss_stats(
    stats: StatSums,
    named: list[tuple[str, torch.Tensor, torch.Tensor]],
    pg: dict[str, torch.Tensor],
    mask: torch.Tensor,
) -> None:
    """Token sums of the policy (and value) loss and clip fractions, the approx KL and the
    ratio of one micro-batch; named: (prefix, per-token loss, clipped) (B, T) each."""
    n = mask.sum()
    for prefix, loss, clipped in named:
        stats.add(f"{prefix}/loss", masked_sum(loss.detach(), mask), n)
        stats.add(f"{prefix}/clipfrac", masked_sum(clipped.detach(), mask), n)
    stats.add("policy/approx_kl", masked_sum(pg["approx_kl"], mask), n)
    stats.add("policy/ratio_mean", masked_sum(pg["ratio"], mask), n)
    stats.add_max("policy/ratio_max", torch.where(mask, pg["ratio"], 0.0).max())


def minibatch_backward(
    runtime: Runtime, model: torch.nn.Module, mb: RolloutBatch, advantages: torch.Tensor,
    returns: torch.Tensor | None, knobs: UpdateKnobs, slices: list[MicroSlice],
    ptx: PtxStream | None = None,
    chosen: torch.Tensor | None = None, teacher: Teacher | None = None,
) -> Backward:  # fmt: skip
    """Accumulate the gradient of one optimizer step over this rank's micro-batches;
    returns the old log-probs and entropies of the micro-batches that had none and the
    step's statistics, the micro-batches' sums joined in order (Backward).

    mb: this rank's share of the global minibatch; slices: its micro-batches. Each
    micro-batch's loss SUM is divided by the count (response tokens or sequences, per
    knobs.loss_aggregation) of the WHOLE global minibatch (share_of_global_mean).
    ptx: the PtxStream with PPO-ptx on (InstructGPT eq. 2): the step's ptx batch, in as
    many micro-batches, adds ptx_coef x its global token-mean NLL (ptx.py), each
    ptx micro-batch with its own forward and backward before PPO micro-batch i's, so the
    step's last backward is PPO's (every parameter gets its gradient there) and each
    forward is followed by its backward, as DeepSpeed's ZeRO-3 hooks require.
    chosen: (b, T) bool for mb's rows, the tokens ppo.cov_control acts on (None: off).
    teacher: on-policy distillation's teacher with distill_loss=gjsd (micro_batch_loss).
    """
    count = runtime.all_sum(aggregation_count(mb.response_mask, knobs.loss_aggregation))
    count = count.clamp(min=1.0)  # ppo.overlong=mask can leave a minibatch without tokens
    ptx_step = None if ptx is None else ptx.next_step(runtime, len(slices))
    first_forwards, parts = [], []  # parts: each micro-batch's StatSums, in order
    # distributed.sequence_parallel_size: the group's micro-batches, each split by columns
    # (validation refuses it with PPO-ptx, so ptx_step is None then)
    pooled = runtime.pool_micro_batches(
        [(s, *_micro_inputs(mb, s, advantages, returns, chosen)) for s in slices]
    )
    routing = update_routing(runtime, model, [m for _, (_, m, *_) in pooled], knobs)
    for i, (own, (s, micro, adv, ret, cho)) in enumerate(pooled):
        if ptx_step is not None:  # + ptx_coef x micro-batch i's share of the ptx token mean
            with runtime.accumulating(model):  # its forward leaves the critic unused
                ptx_loss, ptx_stats = ptx_step.loss(runtime, model, i)
                runtime.micro_backward(model, ptx_loss, last=False)
            parts.append(ptx_stats)
        padding = StatSums()
        padding.add("update/pad_fraction", *padding_cells(micro.attention_mask))
        with runtime.sequence_parallel(), recording(routing) as routed:
            micro_loss = micro_batch_loss(model, micro, adv, ret, knobs, cho, teacher)
        parts += [padding, micro_loss.stats]
        loss = share_of_global_mean(runtime, micro_loss.loss_sum, count)
        if routing is not None:  # + coef x its share of the load-balancing loss
            columns = micro.response_mask.shape[1]  # the responses' tokens are counted
            loss = loss + routing.loss(runtime, routed, micro.attention_mask, padding, columns)
        runtime.micro_backward(model, loss, last=i == len(pooled) - 1)
        if micro_loss.fresh is not None and own:
            first_forwards.append((s, *micro_loss.fresh))
    return Backward(first_forwards, StatSums.joined(parts))


def update_routing(
    runtime: Runtime, model: torch.nn.Module, micro: list[RolloutBatch], knobs: UpdateKnobs
) -> StepRouting | None:
    """A mixture-of-experts actor's load-balancing state for one optimizer step over
    micro-batches `micro` (trainers/moe_aux.py): its expert fractions counted over the
    response tokens of the global minibatch; None for a dense actor or a coefficient of 0."""
    aux = trained_router_aux(knobs.router_aux_loss_coef, model)
    if aux is None:
        return None

    def forward(i: int) -> object:
        m = micro[i]
        return model(m.input_ids, m.attention_mask, m.response_mask, with_critic=False)

    masks = [m.attention_mask for m in micro]
    return step_routing(runtime, aux, masks, forward, [m.response_mask.shape[1] for m in micro])


def _micro_inputs(
    mb: RolloutBatch,
    s: MicroSlice,
    advantages: torch.Tensor,
    returns: torch.Tensor | None,
    chosen: torch.Tensor | None,
) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Micro-batch `s` of minibatch share `mb`, trimmed to the columns some row uses
    (padding in every row costs nothing), with its advantages, returns and cov_control
    tokens (each (b, T) or None)."""
    micro, T = mb.select(s).trimmed()
    ret = None if returns is None else returns[s][:, :T]
    cho = None if chosen is None else chosen[s][:, :T]
    return micro, advantages[s][:, :T], ret, cho


def update_micro_batches(runtime: Runtime, mb: RolloutBatch, plan: BatchPlan) -> list[MicroSlice]:
    """The micro-batches of this rank's share `mb` of a minibatch: `plan.micro_slices()`,
    or with ppo.micro_batch_tokens index tensors from `batching.token_budget_split` of
    each row's (prompt, response) length, the widths `RolloutBatch.trimmed` keeps, into
    as many micro-batches as the busiest rank needs (one all-max: under ZeRO-3 every
    forward/backward is a collective). A function of the rows, so of the seed."""
    if not plan.micro_batch_tokens:
        return plan.micro_slices()
    prompt, response = mb.prompt_mask.sum(1), mb.response_mask.sum(1).clamp(min=1)
    widths = torch.stack([prompt, response], dim=1).tolist()
    budget = plan.micro_batch_tokens
    mine = len(token_budget_split(widths, budget))
    parts = int(runtime.all_max(torch.tensor(mine, dtype=torch.long, device=runtime.device)))
    groups = token_budget_split(widths, budget, parts)
    return [torch.tensor(g, dtype=torch.long, device=mb.response_mask.device) for g in groups]


def ppo_update(
    runtime: Runtime, run: PPORun, batch: RolloutBatch, advantages: torch.Tensor,
    returns: torch.Tensor | None, knobs: UpdateKnobs, it: int = 0, chosen: torch.Tensor | None = None,
) -> UpdateResult:  # fmt: skip
    """ppo_epochs passes over this rank's rollout in minibatches, one optimizer step each;
    returns the reduced statistics and, for a rollout without old log-probs (one step
    per rollout only), those the update's forward computed. chosen: (B, T) bool, the
    tokens ppo.cov_control acts on (entropy.py; None: off)."""
    parts, plan = [], run.plan  # parts: the steps' StatSums, in order
    if batch.old_logprobs is None and plan.optimizer_steps_per_iteration != 1:
        raise ValueError("a rollout without old log-probs gets exactly one optimizer step")
    per_rank, trained = plan.update.per_rank, (run.model, run.optimizer, run.scheduler)
    first_forwards = []
    teacher = run.rollout_models.teacher
    teacher = None if teacher is None else Teacher(teacher, run.rollout_models.perf)
    # ZeRO-3: the weights gathered whole once per optimizer step when a copy fits.
    with runtime.training_weights(run.model, run.gather_for_training, "actor-critic"):
        for _ in range(plan.ppo_epochs):
            order = torch.randperm(batch.response_ids.shape[0], device=batch.response_ids.device)
            for start in range(0, order.numel(), per_rank):
                idx = order[start : start + per_rank]
                mb, ret = batch.select(idx), None if returns is None else returns[idx]
                cho = None if chosen is None else chosen[idx]
                slices = update_micro_batches(runtime, mb, plan.update)
                step = minibatch_backward(
                    runtime, run.model, mb, advantages[idx], ret, knobs, slices, run.ptx,
                    cho, teacher,
                )  # fmt: skip
                first_forwards += [(idx[s], lp, ent) for s, lp, ent in step.first_forwards]
                norms = step_and_schedule(runtime, trained, list(knobs.max_grad_norms))
                grad_norms = StatSums()
                for name, norm in zip(run.group_names, norms or ()):
                    grad_norms.add(f"optim/grad_norm_{name}", norm, 1)
                parts += [step.stats, grad_norms]
                maybe_fault("update", it)  # killed with the weights half-way through an iteration
    stats = StatSums.joined(parts).reduce(runtime)
    if not first_forwards:
        return UpdateResult(stats)
    shape = batch.response_mask.shape
    lp, ent = (rollout_rows(shape, [(r, x[k]) for r, *x in first_forwards]) for k in (0, 1))
    return UpdateResult(stats, lp, ent)


def rollout_rows(shape: torch.Size, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A new (B, T) float32 tensor holding, for each (rows (b,), values (b, T')) of
    `parts`, the values at those rows' first T' columns (the update's micro-batches come
    in shuffled order with trimmed columns); 0 elsewhere."""
    out = torch.zeros(shape, dtype=torch.float32, device=parts[0][1].device)
    for rows, values in parts:
        out[rows, : values.shape[1]] = values.float()
    return out
