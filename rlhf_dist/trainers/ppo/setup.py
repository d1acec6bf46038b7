"""Building PPO's four models for a run and exporting the trained ones.

Full fine-tuning: actor and critic are their own models; the reference and the reward
model are frozen copies (partitioned under ZeRO-3, bf16 if configured). With LoRA, the
reference is the actor's base with adapters off; with a LoRA critic initialised from the
reward model, the frozen reward model is the critic's base with adapters off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlhf_dist.checkpoint import Checkpoint
from rlhf_dist.config import Config
from rlhf_dist.config.sizes import has_critic, needs_reference
from rlhf_dist.data.batching import PPOPlan, ppo_plan
from rlhf_dist.data.chat import export_tokenizer
from rlhf_dist.distributed import Runtime
from rlhf_dist.distributed.runtime import GenerationModule
from rlhf_dist.errors import ConfigError
from rlhf_dist.generation import Sampler, make_sampler
from rlhf_dist.models import (
    ActorCritic,
    ValueModel,
    build_critic,
    frozen_dtype,
    load_causal_lm,
    load_tokenizer,
    policy_stop_ids,
    split_classifier,
    sub_state_dict,
    tokenizer_for,
    train_dtype,
    trained_load_dtype,
)
from rlhf_dist.models.lora import (
    AdapterOffReference,
    adapters_disabled,
    add_adapters,
    export_lora,
    merged_adapters,
)
from rlhf_dist.models.routing import require_routers
from rlhf_dist.models.vision import policy_vision
from rlhf_dist.rewards.scoring import (
    RewardInputs,
    Scorer,
    build_scorer,
    policy_stops_for,
    reward_inputs_for,
)
from rlhf_dist.rollout import RolloutModels
from rlhf_dist.rollout.agent import Agent, build_agent
from rlhf_dist.rollout.endpoint import EndpointAgent, endpoint_agent
from rlhf_dist.trainers.common import (
    finish_trainable,
    make_optimizer,
    make_scheduler,
    save_pretrained,
    save_processor,
)
from rlhf_dist.trainers.ppo.ptx import PtxStream, ptx_stream

if TYPE_CHECKING:  # transformers loads only where a model or tokenizer does
    from transformers import PreTrainedTokenizerBase


@dataclass
class PPOModels:
    model: nn.Module  # prepared ActorCritic (DeepSpeed engine, DDP wrapper or itself)
    optimizer: torch.optim.Optimizer  # as prepared: Accelerate wraps it
    scheduler: torch.optim.lr_scheduler.LRScheduler
    reference: nn.Module
    scorer: Scorer
    group_names: tuple[str, ...]  # the optimizer's param groups: ("actor", "critic") or ("actor",)
    teacher: nn.Module | None = None  # on-policy distillation's frozen teacher (model.teacher)


def check_teacher_tokenizer(cfg: Config, policy_tokenizer: Any) -> None:
    """The teacher scores the policy's own token ids (docs/distill.md), so it must read
    them as the same tokens: the same vocabulary and BOS/EOS ids. Compared on the
    tokenizers alone, before any weights load; one line naming model.teacher."""
    m = cfg.model
    teacher_tokenizer = load_tokenizer(m.teacher, m.trust_remote_code, "model.teacher")
    specials = ("bos_token_id", "eos_token_id")
    a, b = policy_tokenizer, teacher_tokenizer
    if a.get_vocab() != b.get_vocab() or any(getattr(a, n) != getattr(b, n) for n in specials):
        raise ConfigError(
            f"model.teacher: {m.teacher!r} has another tokenizer than the policy (vocabulary "
            "or BOS/EOS ids differ); on-policy distillation scores the policy's token ids, so "
            "the teacher must share its tokenizer"
        )


def _load_teacher(cfg: Config, runtime: Runtime) -> nn.Module:
    """model.teacher, frozen and placed like the reference (model.frozen_dtype,
    distributed.frozen_models: replicated, or partitioned under ZeRO-3)."""
    m, dtype = cfg.model, frozen_dtype(cfg.model)
    with runtime.local_loading():
        teacher = load_causal_lm(m.teacher, "model.teacher", dtype, m)
    return runtime.prepare_frozen(teacher, cfg.distributed.frozen_models, dtype, "teacher")


def _frozen_scorer(
    cfg: Config, runtime: Runtime, reward_inputs: RewardInputs | None
) -> Scorer | None:
    """The reward of the run (rewards.scoring.build_scorer); None where the LoRA critic's
    adapters-off base is the reward model (built after prepare); without a reward source,
    the environment's rewards alone, or zeros for distillation alone
    (ppo.estimator=distill)."""
    if shares_reward_with_critic(cfg):
        return None
    if not (cfg.reward.text_rewards() or cfg.model.reward):
        from_environment = bool(cfg.generation.environment)
        return Scorer(reward_fn=environment_reward if from_environment else no_task_reward)
    placement = cfg.distributed.frozen_models
    settings = (cfg.reward, cfg.perf, policy_stops_for(cfg))  # a reward.functions RM's stops
    return build_scorer(
        runtime, cfg.reward.function, cfg.model, placement, reward_inputs, *settings
    )


def no_task_reward(
    prompts: list[str], responses: list[str], columns: dict[str, list[Any]] | None = None
) -> torch.Tensor:
    """The scores of ppo.estimator=distill without a reward source: 0 for every response
    (B,); the teacher's signal is all that trains."""
    return torch.zeros(len(responses))


def environment_reward(
    prompts: list[str], responses: list[str], columns: dict[str, list[Any]] | None = None
) -> torch.Tensor:
    """The scores of an environment without another reward source: NaN for every response
    (B,), each replaced by the reward the environment gave its episode (rollout/collect.py,
    which stops the run when an episode gave none; a verifiers rubric always gives one)."""
    return torch.full((len(responses),), float("nan"))


class AdapterOffValue(nn.Module):
    """The frozen reward model as the LoRA critic's base with adapters off."""

    def __init__(self, critic_fn: Callable[[], nn.Module]) -> None:
        super().__init__()
        self._critic_fn = critic_fn

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        critic = self._critic_fn()
        with adapters_disabled(critic.classifier):
            return critic(input_ids, attention_mask, position_ids)


def _trainable_actor_critic(cfg: Config, deepspeed: bool) -> ActorCritic:
    """Actor and critic in the dtypes of the precision table (docs/distributed.md): a
    LoRA base as asked, everything trained in fp32 unless DeepSpeed keeps the masters."""
    m, lora = cfg.model, cfg.lora
    actor_dtype = trained_load_dtype(train_dtype(m), deepspeed, frozen_base=lora.enabled)
    actor = load_causal_lm(
        m.policy, "model.policy", actor_dtype, m, lora.enabled and lora.load_in_4bit
    )
    if lora.enabled:
        actor = add_adapters(actor, lora, "CAUSAL_LM")
    if not has_critic(cfg):
        return finish_trainable(ActorCritic(actor, None, cfg.perf), m, deepspeed)
    critic = build_critic(
        cfg, trained_load_dtype(train_dtype(m), deepspeed, frozen_base=lora.critic)
    )
    if lora.critic:
        head_name = _head_name(critic.classifier)
        adapted = add_adapters(critic.classifier, lora, "SEQ_CLS", head_name)
        critic = ValueModel(adapted, cfg.perf)
    return finish_trainable(ActorCritic(actor, critic, cfg.perf), m, deepspeed)


def _head_name(classifier: nn.Module) -> str:
    _, head = split_classifier(classifier)
    return next(name for name, module in classifier.named_children() if module is head)


def shares_reward_with_critic(cfg: Config) -> bool:
    """A LoRA critic from the RM serves as the frozen RM too (adapters off)."""
    return (
        has_critic(cfg)
        and cfg.lora.critic
        and cfg.ppo.critic_init == "reward"
        and not cfg.reward.text_rewards()
    )


def check_critic_tokenizer(cfg: Config, reward_inputs: RewardInputs | None) -> None:
    """A critic reads the policy's tokens in the same forward as the actor, so it cannot
    start from a reward model with another tokenizer or template (docs/data.md)."""
    if reward_inputs is not None and cfg.ppo.critic_init == "reward":
        raise ConfigError(
            f"ppo.critic_init: the reward model {cfg.model.reward!r} has another tokenizer or "
            "chat template than the policy, so a critic started from it cannot read the "
            "policy's tokens; use ppo.critic_init=policy"
        )


def build_models(
    cfg: Config, runtime: Runtime, plan: PPOPlan, total_steps: int, ckpt: Checkpoint | None = None
) -> PPOModels:
    """Load, wrap and prepare the four models of a PPO run."""
    m, p = cfg.model, cfg.ppo
    if m.teacher:  # a tokenizer mismatch is found before any weights load
        check_teacher_tokenizer(cfg, tokenizer_for(cfg, "policy"))
    reward_inputs = reward_inputs_for(cfg)  # the RM's own tokens when its tokenizer differs
    critic = has_critic(cfg)
    if critic:
        check_critic_tokenizer(cfg, reward_inputs)
    if (
        critic
        and runtime.zero_stage is not None
        and p.critic_optim.max_grad_norm != p.optim.max_grad_norm
    ):
        raise ConfigError(
            "ppo.critic_optim.max_grad_norm: DeepSpeed clips actor and critic together at one "
            f"norm; set it equal to ppo.optim.max_grad_norm ({p.optim.max_grad_norm})"
        )
    # Every model is loaded whole on every rank first; DeepSpeed partitions it afterwards.
    with runtime.local_loading():
        net = _trainable_actor_critic(cfg, deepspeed=runtime.zero_stage is not None)
        if ckpt:
            ckpt.load_weights_into(net)  # before prepare: every backend partitions these
        full_reference = needs_reference(cfg) and not cfg.lora.enabled
        reference = _load_reference(cfg) if full_reference else None
        scorer = _frozen_scorer(cfg, runtime, reward_inputs)
    groups = {"actor": (net.actor.parameters(), p.optim)}
    if net.critic is not None:  # built where the estimator reads values (has_critic)
        groups["critic"] = (net.critic.parameters(), p.critic_optim)
    optimizer = make_optimizer(list(groups.values()))
    scheduler = make_scheduler(optimizer, [optim for _, optim in groups.values()], total_steps)
    accumulation = plan.update.accumulation_steps
    model, optimizer = runtime.prepare(
        net,
        optimizer,
        plan.update.micro_batch_size,
        accumulation,
        p.optim.max_grad_norm,
        train_dtype(m),
    )
    if ckpt:
        runtime.restore_optimizer_state(model, optimizer, ckpt.training, ckpt.shards)
    if not needs_reference(cfg):
        reference = None  # KL 0: the rollout takes the old log-probs as the reference's
    elif reference is None:
        reference = AdapterOffReference(lambda: runtime.unwrap(model).actor)
    else:
        placement, dtype = cfg.distributed.frozen_models, frozen_dtype(cfg.model)
        reference = runtime.prepare_frozen(reference, placement, dtype, "reference")
    if scorer is None:
        scorer = Scorer(reward_model=AdapterOffValue(lambda: runtime.unwrap(model).critic))
    # Loaded and placed last: under ZeRO-3 prepare_frozen partitions it like the reference.
    teacher = _load_teacher(cfg, runtime) if m.teacher else None
    return PPOModels(model, optimizer, scheduler, reference, scorer, tuple(groups), teacher)


def _load_reference(cfg: Config) -> nn.Module:
    m = cfg.model
    return load_causal_lm(m.policy, "model.policy", frozen_dtype(cfg.model), m)


def export_models(
    cfg: Config, runtime: Runtime, model: nn.Module, tokenizer: Any, out: Path
) -> None:
    """final/ = the actor (merged if LoRA; adapter in final_adapter/), critic/ = the critic;
    a vision-language actor's exports get its processor (saved first: the run's tokenizer
    is written over the processor's copy)."""
    lora, tokenizer = cfg.lora, export_tokenizer(tokenizer, cfg.data)
    merged = not lora.enabled or lora.export in ("merged", "both")
    adapter = lora.enabled and lora.export in ("adapter", "both")
    exports = [out / "final"] * merged + [out / "final_adapter"] * adapter
    save_processor(runtime, policy_vision(cfg), exports)
    if not lora.enabled:
        save_pretrained(runtime, model, tokenizer, out / "final", "actor", train_dtype(cfg.model))
        if has_critic(cfg):
            save_pretrained(
                runtime,
                model,
                tokenizer,
                out / "critic",
                "critic.classifier",
                train_dtype(cfg.model),
            )
        return
    state = runtime.full_state_dict(model)
    if runtime.is_main:
        assert state is not None  # Runtime.full_state_dict gives it to the main process
        with runtime.local_loading():
            _export_lora_models(cfg, runtime, model, tokenizer, out, state)
    runtime.barrier()


def _export_lora_models(
    cfg: Config, runtime: Runtime, model: nn.Module, tokenizer: Any, out: Path, state: dict
) -> None:
    """On the main process: rebuild the LoRA actor (and critic) on CPU from `state`, export."""
    m, lora = cfg.model, cfg.lora
    merged = out / "final" if lora.export in ("merged", "both") else None
    adapter = out / "final_adapter" if lora.export in ("adapter", "both") else None

    def policy_base() -> nn.Module:
        return load_causal_lm(m.policy, "model.policy", train_dtype(m), m)

    export_lora(state, "actor.", policy_base, lora, "CAUSAL_LM", None, merged, adapter)
    if lora.critic:
        critic_base = build_critic(cfg, train_dtype(m)).classifier
        head = _head_name(critic_base)
        export_lora(
            state,
            "critic.classifier.",
            lambda: critic_base,
            lora,
            "SEQ_CLS",
            head,
            out / "critic",
            None,
        )
    elif has_critic(cfg):
        own = sub_state_dict(state, "critic.classifier.")
        critic = runtime.unwrap(model).critic.classifier
        critic.save_pretrained(out / "critic", state_dict=own, safe_serialization=True)
    for directory in filter(None, (merged, adapter, out / "critic" if has_critic(cfg) else None)):
        tokenizer.save_pretrained(directory)


def start_ppo(
    cfg: Config,
    runtime: Runtime,
    ckpt: Checkpoint | None,
    tokenizer: PreTrainedTokenizerBase,
    sampler: Sampler | None = None,
) -> PPORun:
    """Load data and models (from a checkpoint if resuming) into a PPORun; `sampler`
    (None: generation.backend's) is what samples its rollouts."""
    p = cfg.ppo
    plan = ppo_plan(p, runtime.world_size)
    # PPO-ptx rows, before any model loads (a data mistake is found first); one global
    # batch of ppo.minibatch_size rows per optimizer step, from where the checkpoint was.
    position = ckpt.trainer.get("ptx_position", 0) if ckpt else 0
    ptx = ptx_stream(cfg, runtime, tokenizer, plan.update, position)
    # The multi-turn agent too (tools resolved, the template checked to show them): None
    # without generation.tools / environment; played through the endpoint with
    # generation.environment_endpoint.
    agent = endpoint_agent(cfg) or build_agent(cfg, tokenizer)
    total_steps = p.iterations * plan.optimizer_steps_per_iteration
    built = build_models(cfg, runtime, plan, total_steps, ckpt)
    model = built.model
    if p.routing_replay != "none":  # a dense actor, or one that recomputes in backward
        require_routers(model, f"ppo.routing_replay={p.routing_replay}")

    rollout_models = make_rollout_models(cfg, runtime, built, tokenizer, agent, sampler)
    if ckpt:  # the learning rate's schedule continues where the checkpoint was
        built.scheduler.load_state_dict(ckpt.trainer["scheduler"])
    return PPORun(
        model,
        built.optimizer,
        built.scheduler,
        rollout_models,
        tokenizer,
        plan,
        built.group_names,
        built.scorer,
        cfg.perf.gather_for_training,
        ptx=ptx,
        first_iteration=(ckpt.step if ckpt else 0) + 1,
    )


def make_rollout_models(
    cfg: Config,
    runtime: Runtime,
    built: PPOModels,
    tokenizer: Any,
    agent: Agent | EndpointAgent | None,
    sampler: Sampler | None = None,
) -> RolloutModels:
    """What a rollout reads: the actor (generated from through `generation_context`), the
    frozen models, the stop ids, the sampler (None: generation.backend's), the agent and
    the scoring split."""
    model = built.model
    gather = cfg.perf.gather_for_generation
    # LoRA: generate with the adapters folded into the base (whole tensors only: not
    # through ZeRO-3's per-layer gathers).
    merge = cfg.lora.enabled and (runtime.zero_stage != 3 or gather)

    @contextlib.contextmanager
    def generation_context() -> Iterator[GenerationModule]:
        with contextlib.ExitStack() as stack:
            actor, keep_in_step = stack.enter_context(
                runtime.generation_context(model, "actor", gather)
            )
            yield (stack.enter_context(merged_adapters(actor)) if merge else actor), keep_in_step

    stops = policy_stop_ids(cfg, tokenizer)
    if sampler is None:  # generation.backend's (generation/factory.py)
        sampler = make_sampler(cfg, runtime, model, generation_context)
    return RolloutModels(
        model,
        generation_context,
        built.reference,
        built.scorer,
        stops,
        sampler,
        whole_weights=lambda: runtime.whole_weights(model, gather),
        agent=agent,
        any_rank=runtime.any_rank if runtime.world_size > 1 else None,
        perf=cfg.perf,
        teacher=built.teacher,  # model.teacher: scores the rollout (docs/distill.md)
        # distributed.sequence_parallel_size: scoring's forwards split over the group
        pool=runtime.pool_micro_batches if runtime.sequence_parallel_size > 1 else None,
        has_critic=has_critic(cfg),
        split=runtime.sequence_parallel,
        routing_replay=cfg.ppo.routing_replay,
    )


@dataclass(frozen=True)
class PPORun:
    """The live objects of a PPO run (what one iteration reads and trains). Frozen: no
    field is reassigned; the objects that do change over a run are the trained model, its
    optimizer and scheduler and the ptx stream's position, each in the checkpoint
    (state.trainer_state). The controllers are the iteration's state, not the run's
    (controllers.Controllers: each iteration takes them and returns new ones)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rollout_models: RolloutModels
    tokenizer: PreTrainedTokenizerBase
    plan: PPOPlan
    group_names: tuple[str, ...]  # the optimizer's param groups, e.g. ("actor", "critic")
    scorer: Scorer  # rollout_models' scorer: its failures and per-component statistics
    gather_for_training: str = "auto"  # perf.gather_for_training
    ptx: PtxStream | None = None  # PPO-ptx's SFT rows (ppo.ptx_coef > 0), ptx.py
    first_iteration: int = 1  # this process's first iteration (after a resume: step + 1)
