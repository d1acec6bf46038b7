"""Named presets of `rlhf-dist ppo`: the keys that make it GRPO, Dr. GRPO, DAPO, GSPO,
RLOO, REINFORCE++ or online DPO, so a user need not know that GRPO is `ppo.estimator=grpo` plus four
more keys. A preset lies UNDER the user's file and overrides: any key the user sets wins
(docs/grpo.md lists each preset's keys and where its numbers come from)."""

from __future__ import annotations

from typing import Any

# GRPO as TRL's GRPOTrainer runs it by default (TRL 1.16: num_generations 8, beta 0, one
# optimizer step per generation batch, temperature 1, lr 1e-6, loss_type "dapo", which is
# a token mean over the batch), group-normalised advantages (DeepSeekMath).
GRPO: dict[str, Any] = {
    "ppo.estimator": "grpo",
    "ppo.samples_per_prompt": 8,
    "ppo.rollout_batch_size": 16,
    "ppo.kl_placement": "loss",
    "ppo.kl_kind": "k3",
    "ppo.kl_coef": 0.0,
    "ppo.loss_aggregation": "token_mean",
    "ppo.optim.lr": 1e-6,
    "generation.temperature": 1.0,
}

# Online DPO as TRL's OnlineDPOTrainer runs it by default (OnlineDPOConfig: 2 completions
# per prompt, beta 0.1, the sigmoid loss, temperature 0.9, lr 5e-7, one optimizer step
# per generation batch); here beta is ppo.kl_coef (docs/online_dpo.md).
ONLINE_DPO: dict[str, Any] = {
    "ppo.estimator": "online_dpo",
    "ppo.samples_per_prompt": 2,
    "ppo.kl_coef": 0.1,
    "ppo.dpo_loss": "sigmoid",
    "ppo.optim.lr": 5e-7,
    "generation.temperature": 0.9,
}

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": GRPO,
    # Dr. GRPO (Liu et al. 2025): no std normalisation, no per-sequence length mean
    "dr_grpo": GRPO
    | {"ppo.grpo_std_normalize": False, "ppo.loss_aggregation": "seq_mean_token_sum"},
    # DAPO (Yu et al. 2025): clip-higher, token mean, dynamic sampling, soft overlong penalty
    "dapo": GRPO
    | {
        "ppo.clip_eps": 0.2,
        "ppo.clip_eps_high": 0.28,
        "ppo.dynamic_sampling": True,
        "ppo.overlong": "soft",
        "ppo.overlong_buffer": 128,
    },
    # GSPO (Zheng et al. 2025): the length-normalised sequence ratio, clipped at the paper's
    # 3e-4 / 4e-4, per-sequence token means
    "gspo": GRPO
    | {
        "ppo.ratio_level": "sequence",
        "ppo.loss_aggregation": "seq_mean_token_mean",
        "ppo.clip_eps_low": 3e-4,
        "ppo.clip_eps_high": 4e-4,
    },
    # RLOO (Ahmadian et al. 2024): the leave-one-out baseline of 4 samples
    "rloo": GRPO | {"ppo.estimator": "rloo", "ppo.samples_per_prompt": 4},
    # REINFORCE++ (Hu 2025): KL in the reward, return-to-go, global whitening
    "reinforce_pp": GRPO
    | {
        "ppo.estimator": "reinforce_pp",
        "ppo.samples_per_prompt": 1,
        "ppo.rollout_batch_size": 64,
        "ppo.kl_placement": "reward",
        "ppo.kl_kind": "k2",
        "ppo.kl_coef": 0.01,
    },
    "online_dpo": ONLINE_DPO,
}


def preset_tree(name: str | None) -> dict[str, Any]:
    """The nested config tree of preset `name` (None: empty)."""
    if name is None:
        return {}
    tree: dict[str, Any] = {}
    for dotted, value in PRESETS[name].items():
        node = tree
        *parents, last = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


# The stage every preset configures: `rlhf-dist grpo` is `rlhf-dist ppo --preset grpo`.
PRESET_STAGE = "ppo"


def stage_and_preset(name: str, preset: str | None = None) -> tuple[str, str | None]:
    """(stage, preset) that command, plan stage or starter name `name` runs: a preset's
    own name (`rlhf-dist grpo`, `rlhf-dist plan --stage grpo`, `rlhf-dist config --yaml
    dapo`) is the ppo stage with that preset; a stage's name is that stage with `preset`
    (`rlhf-dist ppo --preset NAME`; None: none). The one place this mapping is written."""
    if name in PRESETS:
        return PRESET_STAGE, name
    return name, preset
