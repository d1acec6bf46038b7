"""The step-loop stages (rlhf-dist sft, rm, dpo, kto): the keys they share (`StageConfig`),
the optimizer section every stage names `optim` (`OptimConfig`; PPO's `ppo.optim` and
`ppo.critic_optim` too), then each stage's own keys."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_dist.config.keys import key
from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)
from rlhf_dist.names import DPO_LOSS_TYPES


@dataclass(frozen=True)
class OptimConfig:
    lr: float = key(1e-4, "peak learning rate of AdamW", gt=0)
    weight_decay: float = key(0.0, "AdamW weight decay")
    adam_eps: float = key(1e-5, "AdamW epsilon", gt=0)
    max_grad_norm: float = key(1.0, "gradients are clipped to this global L2 norm", gt=0)
    warmup_steps: int = key(0, "optimizer steps of linear warmup up to lr", min=0)
    schedule: str = key(
        "constant",
        "learning rate after warmup: constant, or decaying to 0 by the last optimizer step",
        choices=("constant", "linear", "cosine"),
    )


@dataclass(frozen=True)
class StageConfig:
    """The keys every step-loop stage (sft, rm, dpo, kto) shares, declared once. A stage's
    row is its unit: a sequence (SFT), a preference pair (RM, DPO), an example (KTO). Each
    stage adds its own `optim` (the same OptimConfig, a stage's own default learning rate)
    and its own keys."""

    epochs: int = key(1, "passes over data.train", gt=0)
    batch_size: int = key(
        32,
        "rows per optimizer step, summed over all ranks (sequences for sft, preference pairs "
        "for rm and dpo, examples for kto)",
        gt=0,
    )
    micro_batch_size: int = key(
        0,
        "rows per forward/backward pass, per rank; 0 = the per-rank share of a batch in "
        "micro-batches of at most 8 (the largest divisor), so any world size that divides "
        "the batch works",
        min=0,
    )
    micro_batch_tokens: int = key(
        0,
        "token budget of one forward/backward pass, per rank: rows longest first, cut so "
        "that rows x sequences per row x the longest sequence stays within it (a longer row "
        "alone; a pair is 2 sequences); 0 = off (micro_batch_size rows)",
        min=0,
    )


@dataclass(frozen=True)
class SFTConfig(StageConfig):
    optim: OptimConfig = key(OptimConfig(lr=2e-5), "optimizer of the policy (TRL's SFT lr)")


@dataclass(frozen=True)
class RMConfig(StageConfig):
    optim: OptimConfig = key(OptimConfig(lr=1e-5), "optimizer of the reward model")
    responses_field: str = key(
        "responses", "column of ranked lists (best first), expanded to all C(n, 2) pairs"
    )


REFERENCE_LOGPROBS = ("precompute", "online")


@dataclass(frozen=True)
class DPOConfig(StageConfig):
    optim: OptimConfig = key(OptimConfig(lr=1e-6), "optimizer of the policy (TRL's DPO lr)")
    beta: float = key(
        0.1,
        "strength of the KL constraint to the reference: the implicit reward is beta x "
        "(log pi - log pi_ref); IPO's tau; simpo: the reward scale, beta x the mean token "
        "log-prob (SimPO's paper: 2 to 10); orpo: lambda, the weight of the odds-ratio term",
        gt=0,
    )
    loss_type: str = key(
        "sigmoid",
        "sigmoid: DPO (Rafailov et al. 2023), with dpo.label_smoothing conservative DPO; ipo: "
        "IPO (Azar et al. 2023), the log-ratio margin regressed onto 1 / (2 beta); simpo: "
        "SimPO (Meng et al. 2024), length-normalised rewards and the margin dpo.simpo_gamma; "
        "orpo: ORPO (Hong et al. 2024), the chosen responses' NLL plus beta x the odds-ratio "
        "loss. simpo and orpo use no reference model: none is loaded",
        choices=DPO_LOSS_TYPES,
    )
    label_smoothing: float = key(
        0.0,
        "conservative DPO: the probability that a label is flipped, in [0, 0.5); sigmoid and "
        "simpo only",
        min=0,
        lt=0.5,
    )
    simpo_gamma: float = key(
        0.5,
        "SimPO's target reward margin gamma (TRL's default; the paper tunes gamma / beta "
        "around 0.5); simpo only",
        min=0,
    )
    orpo_prompt_nll: bool = key(
        True,
        "ORPO's NLL term covers the chosen sequences' prompt tokens as well as their "
        "responses, as the ORPO authors' code and TRL's ORPOTrainer do; false: the response "
        "tokens only, as rlhf-dist sft trains; orpo only",
    )
    reference_logprobs: str = key(
        "precompute",
        "reference log-probs computed in one pass over the data before training (kept in "
        "<output_dir>/reference_logprobs.json and reused on resume; a full-model reference is "
        "freed afterwards), or online: a reference forward in every step",
        choices=REFERENCE_LOGPROBS,
    )
    responses_field: str = key(
        "responses", "column of ranked lists (best first), expanded to all C(n, 2) pairs"
    )


@dataclass(frozen=True)
class KTOConfig(StageConfig):
    optim: OptimConfig = key(OptimConfig(lr=1e-6), "optimizer of the policy (TRL's KTO lr)")
    beta: float = key(0.1, "scale of the implicit reward beta x (log pi - log pi_ref)", gt=0)
    desirable_weight: float = key(
        1.0, "lambda_D, the weight of desirable examples (raise it when they are fewer)", gt=0
    )
    undesirable_weight: float = key(1.0, "lambda_U, the weight of undesirable examples", gt=0)
    reference_logprobs: str = key(
        "precompute",
        "as dpo.reference_logprobs: one pass before training (resumable) or online",
        choices=REFERENCE_LOGPROBS,
    )
    completion_field: str = key(
        "completion",
        "column of an unpaired row's response (rows: prompt, completion, label); rows with "
        "chosen/rejected (or ranked responses) give desirable chosen and undesirable rejected",
    )
    label_field: str = key("label", "column of an unpaired row's label: true = desirable")
    responses_field: str = key(
        "responses",
        "column of ranked lists (best first): every response preferred to another is desirable, "
        "every one dispreferred undesirable (middle ones are both and are skipped)",
    )
