"""The root `Config`: one frozen section per concern, in the order `rlhf-dist config`
lists them."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_dist.config.keys import key
from rlhf_dist.config.model import DataConfig, LoRAConfig, ModelConfig
from rlhf_dist.config.rl import EvalConfig, GenerationConfig, IterateConfig, PPOConfig, RewardConfig
from rlhf_dist.config.run import AlertsConfig, DebugConfig, DistributedConfig, PerfConfig, RunConfig
from rlhf_dist.config.serve import ServeConfig
from rlhf_dist.config.stages import DPOConfig, KTOConfig, RMConfig, SFTConfig
from rlhf_dist.errors import ConfigError, RewardFunctionError, UserError  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class Config:
    run: RunConfig = key(RunConfig(), "output, logging, checkpoints, resume")
    model: ModelConfig = key(ModelConfig(), "which models, their dtype and loading")
    data: DataConfig = key(DataConfig(), "data files and tokenisation limits")
    sft: SFTConfig = key(SFTConfig(), "batches and optimizer of rlhf-dist sft")
    rm: RMConfig = key(RMConfig(), "batches and optimizer of rlhf-dist rm")
    ppo: PPOConfig = key(PPOConfig(), "batches, optimizers, losses and KL penalty of rlhf-dist ppo")
    dpo: DPOConfig = key(
        DPOConfig(), "batches, optimizer and loss of rlhf-dist dpo (DPO, cDPO, IPO)"
    )
    kto: KTOConfig = key(KTOConfig(), "batches, optimizer and loss of rlhf-dist kto")
    generation: GenerationConfig = key(GenerationConfig(), "sampling of responses (PPO, eval)")
    reward: RewardConfig = key(
        RewardConfig(), "the reward: a function instead of model.reward, shaping"
    )
    eval: EvalConfig = key(EvalConfig(), "what rlhf-dist eval scores and compares")
    lora: LoRAConfig = key(LoRAConfig(), "LoRA adapters (PPO, DPO, KTO)")
    alerts: AlertsConfig = key(AlertsConfig(), "PPO health and reward-hacking alerts")
    debug: DebugConfig = key(DebugConfig(), "debugging aids (PPO)")
    perf: PerfConfig = key(
        PerfConfig(), "how fast: the speed paths, each of which can be turned off"
    )
    distributed: DistributedConfig = key(
        DistributedConfig(), "placement of models across ranks, timeouts"
    )
    iterate: IterateConfig = key(
        IterateConfig(), "rlhf-dist iterate: rounds of sampling, labelling, RM and PPO"
    )
    serve: ServeConfig = key(
        ServeConfig(), "rlhf-dist serve: the rollout server's address, token and limits"
    )
