"""The memory plan of a run: the per-rank peak of each phase and the terms that make it up.

`build_plan(cfg, stage, shapes, hardware)` turns a frozen Config, the architecture numbers
of its models (`memory.ModelShape`, read by `shapes.py`) and the machine (`Hardware`) into
a `Plan`: one `Phase` per part of the stage (PPO: generation, scoring, update; DPO/KTO with
a precomputed reference: reference pass, update; SFT and RM: update), each a list of named
byte terms. Torch-free: a 70B model is planned in milliseconds. The arithmetic of each term
is in `memory.py`; this module decides which terms a configuration has.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_dist.config import Config, sizes
from rlhf_dist.names import ESTIMATORS
from rlhf_dist.planning import memory as mem
from rlhf_dist.planning.memory import GIB, ModelShape

# What the CUDA context, cuBLAS workspaces and the caching allocator's fragmentation take
# besides tensors: the plan must fit in the device's memory minus this.
DEVICE_RESERVE = 1 * GIB
# distributed.frozen_models=auto and perf.gather_for_training=auto replicate / gather a
# model when one copy takes at most this share of the device (distributed/inference.py).
AUTO_COPY_SHARE = 0.25


@dataclass(frozen=True)
class Hardware:
    """Where the run goes: `gpus` ranks with `memory` bytes each, the DeepSpeed ZeRO stage
    of the launch config (None: no DeepSpeed), its offload (none, optimizer, all) and the
    device kind (cuda; cpu for the CPU validation, where dtype auto means fp32)."""

    gpus: int = 1
    memory: float = 80 * GIB
    zero_stage: int | None = None
    offload: str = "none"
    device: str = "cuda"

    @property
    def budget(self) -> float:
        return self.memory - (DEVICE_RESERVE if self.device == "cuda" else 0)


@dataclass(frozen=True)
class Phase:
    """One phase's per-rank peak: (name, bytes) terms, summed."""

    name: str
    terms: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(b for _, b in self.terms)


@dataclass(frozen=True)
class Plan:
    stage: str
    phases: tuple[Phase, ...]
    hardware: Hardware

    @property
    def binding(self) -> Phase:
        """The phase with the largest peak: the one that decides whether the run fits."""
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return self.binding.total <= self.hardware.budget


@dataclass(frozen=True)
class Shapes:
    """The architecture of each model a stage may load (None: not loaded)."""

    policy: ModelShape
    reward: ModelShape | None = None
    teacher: ModelShape | None = None


@dataclass(frozen=True)
class Precision:
    """Bytes per element: trained weights as DeepSpeed holds them (`weights`), frozen
    models' weights (`frozen`), activations and KV cache (`compute`)."""

    weights: float
    frozen: float
    compute: float
    autocast: bool  # bf16 compute over fp32 weights (no DeepSpeed): weight copies per forward


def precision(cfg: Config, hw: Hardware) -> Precision:
    """model.dtype / frozen_dtype resolved as the run resolves them: auto = bf16 on a GPU,
    fp32 on CPU; without DeepSpeed trained weights stay fp32 (models/loading.py)."""
    dtype = cfg.model.dtype
    if dtype == "auto":
        dtype = "bfloat16" if hw.device == "cuda" else "float32"
    frozen = dtype if cfg.model.frozen_dtype == "auto" else cfg.model.frozen_dtype
    b = mem.DTYPE_BYTES[dtype]
    return Precision(b, mem.DTYPE_BYTES[frozen], b, hw.zero_stage is None and b < mem.FP32)


def attention_kind(cfg: Config, hw: Hardware) -> str:
    """What the attention kernel keeps (memory.layer_activation_elements): eager, CPU sdpa
    (with its mask), or a fused GPU kernel."""
    impl = cfg.model.attn_implementation
    if impl == "eager":
        return "eager"
    return "sdpa_cpu" if hw.device == "cpu" else "fused"


def checkpointing(cfg: Config, hw: Hardware) -> bool:
    """model.gradient_checkpointing; null = on with a GPU, off on CPU."""
    g = cfg.model.gradient_checkpointing
    return (hw.device == "cuda") if g is None else g


def lora_base_bytes(cfg: Config, shape: ModelShape, pr: Precision) -> float:
    """Bytes of a LoRA base (frozen): in the compute dtype, or QLoRA's 4-bit linears
    with their quantisation constants and everything else in the compute dtype."""
    total = shape.lm_params()
    if not cfg.lora.load_in_4bit:
        return total * pr.compute
    q = shape.quantizable_params()
    return q * (mem.DTYPE_BYTES["nf4"] + mem.NF4_CONSTANTS) + (total - q) * pr.compute


def trained_states(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> mem.ModelStates:
    """The trained model(s) of `stage`: the policy (SFT, DPO, KTO, PPO's actor), the reward
    model (RM), and PPO's critic when its estimator needs one (one engine, one optimizer
    for actor + critic: their states add up)."""
    pr = precision(cfg, hw)
    lora = cfg.lora.enabled and stage in ("ppo", "dpo", "kto")
    if stage == "rm":
        trainable, frozen = (shapes.reward or shapes.policy).scorer_params(), 0.0
    elif lora:
        trainable = shapes.policy.lora_params(cfg.lora.r, cfg.lora.target_modules)
        frozen = lora_base_bytes(cfg, shapes.policy, pr)
    else:
        trainable, frozen = shapes.policy.lm_params(), 0.0
    if stage == "ppo" and ESTIMATORS[cfg.ppo.estimator].needs_critic:
        critic = critic_shape(cfg, shapes)
        if cfg.lora.enabled and cfg.lora.critic:
            trainable += critic.lora_params(cfg.lora.r, cfg.lora.target_modules) + critic.hidden
            frozen += critic.scorer_params() * pr.compute
        else:
            trainable += critic.scorer_params()
    return mem.model_states(trainable, frozen, pr.weights, hw.zero_stage, hw.gpus, hw.offload)


def critic_shape(cfg: Config, shapes: Shapes) -> ModelShape:
    """The critic starts from the reward model (ppo.critic_init=reward) or the policy."""
    if cfg.ppo.critic_init == "reward" and shapes.reward is not None:
        return shapes.reward
    return shapes.policy


def frozen_models(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> list[tuple[str, float]]:
    """Bytes per rank of each frozen model `stage` keeps resident: PPO's reference (kl_coef
    > 0, not LoRA: adapters off), reward model (no text rewards; not with lora.critic,
    where it is the critic's base) and teacher; DPO/KTO's reference when computed online
    (not LoRA; simpo and orpo use none). Partitioned over the ranks under ZeRO-3 when
    distributed.frozen_models says so (auto: when a copy exceeds a quarter of the
    device), nothing on the device when offloaded."""
    pr = precision(cfg, hw)
    models: list[tuple[str, float]] = []
    if stage == "ppo":
        if cfg.ppo.kl_coef > 0 and not cfg.lora.enabled:
            models.append(("reference", shapes.policy.lm_params()))
        critic_base = cfg.lora.critic and ESTIMATORS[cfg.ppo.estimator].needs_critic
        if not cfg.reward.text_rewards() and shapes.reward is not None and not critic_base:
            models.append(("reward model", shapes.reward.scorer_params()))
        if shapes.teacher is not None:
            models.append(("teacher", shapes.teacher.lm_params()))
    elif stage in ("dpo", "kto") and uses_online_reference(cfg, stage):
        models.append(("reference", shapes.policy.lm_params()))
    return [(name, frozen_share(cfg, hw, n * pr.frozen)) for name, n in models]


def uses_online_reference(cfg: Config, stage: str) -> bool:
    """A full reference model resident during DPO/KTO training: online reference
    log-probs, a reference-based loss, no LoRA (whose reference is the adapters-off base)."""
    section = getattr(cfg, stage)
    no_reference = stage == "dpo" and cfg.dpo.loss_type in ("simpo", "orpo")
    return section.reference_logprobs == "online" and not no_reference and not cfg.lora.enabled


def frozen_share(cfg: Config, hw: Hardware, nbytes: float) -> float:
    """One frozen model's bytes on this rank under distributed.frozen_models."""
    placement = cfg.distributed.frozen_models
    if hw.zero_stage != 3:
        return nbytes
    if placement == "offload":
        return 0.0
    if placement == "auto":
        placement = "replicate" if nbytes <= AUTO_COPY_SHARE * hw.budget else "partition"
    return nbytes / hw.gpus if placement == "partition" else nbytes


# Sequences one row of a stage's micro-batch holds: a pair for RM and DPO.
SEQUENCES_PER_ROW = {"sft": 1, "rm": 2, "dpo": 2, "kto": 1}


def resident(cfg: Config, shapes: Shapes, hw: Hardware, stage: str, update: bool) -> list:
    """What every phase holds: the trained states (gradients only during the update
    without DeepSpeed, which frees them with zero_grad(set_to_none); DeepSpeed keeps its
    gradient partitions) and the frozen models."""
    s = trained_states(cfg, shapes, hw, stage)
    terms = [("weights", s.params), ("optimizer states", s.optimizer)]
    if update or hw.zero_stage is not None:
        terms.insert(1, ("gradients", s.grads))
    return terms + [(name, b) for name, b in frozen_models(cfg, shapes, hw, stage) if b]


@dataclass(frozen=True)
class Batch:
    """One forward/backward pass: `sequences` of `length` tokens, `scored` of them
    through the output head per sequence."""

    sequences: float
    length: int
    scored: int


def update_terms(cfg: Config, shapes: Shapes, hw: Hardware, stage: str, batch: Batch) -> list:
    """One micro-batch's forward + backward on top of the resident states: activations
    (the policy's; PPO's critic runs in the same backward), backward workspace, the head's
    logits, autocast's bf16 weight copies and ZeRO-3's gathered copy."""
    pr, ckpt, attn = precision(cfg, hw), checkpointing(cfg, hw), attention_kind(cfg, hw)
    lora_r = cfg.lora.r if cfg.lora.enabled and stage in ("ppo", "dpo", "kto") else 0
    model = (shapes.reward or shapes.policy) if stage == "rm" else shapes.policy
    b, s = batch.sequences, batch.length
    act = mem.training_activations(model, b, s, pr.compute, attn, ckpt, lora_r)
    terms = [("activations", act)]
    if stage == "ppo" and ESTIMATORS[cfg.ppo.estimator].needs_critic:
        critic = critic_shape(cfg, shapes)
        terms.append(("critic activations", mem.training_activations(critic, b, s, pr.compute, attn, ckpt)))  # fmt: skip
    terms.append(("backward workspace", mem.backward_workspace(model, b, s, pr.compute)))
    if stage != "rm":
        tokens = int(b * batch.scored)
        terms.append(("logits", mem.head_bytes(model, tokens, cfg.perf.logprob_chunk_tokens, True)))  # fmt: skip
    if pr.autocast and not lora_r:
        terms.append(("bf16 weight copies (autocast)", 2.0 * model.layers * model.linear_params()))
    if hw.zero_stage == 3 and gathers_for_training(cfg, hw, model, pr):
        terms.append(("gathered weights (ZeRO-3)", model.lm_params() * pr.weights))
    return terms


def gathers_for_training(cfg: Config, hw: Hardware, model: ModelShape, pr: Precision) -> bool:
    """perf.gather_for_training: always, never, or auto (a copy within a quarter)."""
    mode = cfg.perf.gather_for_training
    if mode == "auto":
        return model.lm_params() * pr.weights <= AUTO_COPY_SHARE * hw.budget
    return mode == "always"


def generation_terms(cfg: Config, shapes: Shapes, hw: Hardware, rows: int) -> list:
    """PPO's sampling of `rows` sequences at once: vLLM's reserved share of the device, or
    our decode loop's KV cache, prefill and sampling tensors; under ZeRO-3 the gathered
    actor (perf.gather_for_generation); with LoRA the merged copies of the adapted
    weights the rollout generates with."""
    pr, g = precision(cfg, hw), cfg.generation
    p, t = cfg.data.max_prompt_length, g.max_new_tokens
    actor = shapes.policy
    if g.backend == "vllm":
        terms = [("vLLM engine share", g.vllm_gpu_memory_utilization * hw.memory)]
    else:
        terms = [
            ("KV cache", mem.kv_cache(actor, rows, p + t, pr.compute)),
            ("prefill", mem.inference_forward(actor, rows, p, pr.compute, attention_kind(cfg, hw))),
            ("sampling", mem.sampling_workspace(actor, rows)),
        ]
    if hw.zero_stage == 3 and cfg.perf.gather_for_generation:
        terms.append(("gathered actor (ZeRO-3)", actor.lm_params() * pr.compute))
    elif cfg.lora.enabled and g.backend == "hf" and hw.zero_stage != 3:
        terms.append(("merged LoRA weights", actor.quantizable_params() * pr.compute))
    return terms


def scoring_terms(cfg: Config, shapes: Shapes, hw: Hardware, rows: int) -> list:
    """Rollout scoring of `rows` sequences per forward, no gradients: the largest model's
    forward (one at a time: actor, reference, critic, reward model, teacher) and the
    output head's chunks over the response tokens."""
    pr, attn = precision(cfg, hw), attention_kind(cfg, hw)
    s = cfg.data.max_prompt_length + cfg.generation.max_new_tokens
    models = [m for m in (shapes.policy, shapes.reward, shapes.teacher) if m is not None]
    forward = max(mem.inference_forward(m, rows, s, pr.compute, attn) for m in models)
    tokens = rows * cfg.generation.max_new_tokens
    head = mem.head_bytes(shapes.policy, tokens, cfg.perf.logprob_chunk_tokens, False)
    return [("forward", forward), ("logits", head)]


def build_plan(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> Plan:
    """The plan of `stage` (sft, rm, ppo, dpo, kto) under `cfg` on `hw`."""
    if stage == "ppo":
        return Plan(stage, ppo_phases(cfg, shapes, hw), hw)
    return Plan(stage, step_loop_phases(cfg, shapes, hw, stage), hw)


def ppo_phases(cfg: Config, shapes: Shapes, hw: Hardware) -> tuple[Phase, ...]:
    """Generation, scoring and update of one PPO iteration, per rank. A vLLM engine that
    does not sleep keeps its share through scoring and the update too."""
    p, g = cfg.ppo, cfg.generation
    per_rank = max(1, p.rollout_batch_size // hw.gpus) * p.samples_per_prompt
    rows = min(p.rollout_micro_batch_size, per_rank)
    minibatch = sizes.ppo_minibatch_size(p.minibatch_size, p.rollout_batch_size, p.samples_per_prompt)  # fmt: skip
    length = cfg.data.max_prompt_length + g.max_new_tokens
    micro = sizes.micro_batch_size(p.micro_batch_size, minibatch, hw.gpus)
    batch = Batch(budget_rows(micro, p.micro_batch_tokens, length), length, g.max_new_tokens)
    awake = []
    if g.backend == "vllm" and not g.vllm_sleep:
        awake = [("vLLM engine share", g.vllm_gpu_memory_utilization * hw.memory)]
    base, train = resident(cfg, shapes, hw, "ppo", False), resident(cfg, shapes, hw, "ppo", True)
    return (
        Phase("generation", tuple(base + generation_terms(cfg, shapes, hw, rows))),
        Phase("scoring", tuple(base + awake + scoring_terms(cfg, shapes, hw, rows))),
        Phase("update", tuple(train + awake + update_terms(cfg, shapes, hw, "ppo", batch))),
    )


def budget_rows(rows: int, token_budget: int, length: int) -> float:
    """Sequences in one pass: `rows`, or with a token budget as many as fit in it (a
    longer sequence alone)."""
    return max(1, token_budget // length) if token_budget else rows


def step_loop_phases(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> tuple[Phase, ...]:
    """SFT, RM, DPO, KTO: the update of one micro-batch (a row is a pair for RM and DPO)
    and, for DPO/KTO with reference log-probs computed before training, that pass."""
    section = getattr(cfg, stage)
    micro = sizes.micro_batch_size(section.micro_batch_size, section.batch_size, hw.gpus)
    length, per_row = cfg.data.max_length, SEQUENCES_PER_ROW[stage]
    rows = budget_rows(micro * per_row, section.micro_batch_tokens, length)
    batch = Batch(rows, length, length)
    phases = []
    if stage in ("dpo", "kto") and needs_reference_pass(cfg, stage):
        pr = precision(cfg, hw)
        ref = frozen_share(cfg, hw, shapes.policy.lm_params() * pr.frozen)
        forward = mem.inference_forward(shapes.policy, rows, length, pr.compute, attention_kind(cfg, hw))  # fmt: skip
        head = mem.head_bytes(shapes.policy, int(rows * length), cfg.perf.logprob_chunk_tokens, False)  # fmt: skip
        terms = resident(cfg, shapes, hw, stage, False)
        terms += [("reference", ref), ("forward", forward), ("logits", head)]
        phases.append(Phase("reference pass", tuple(terms)))
    terms = resident(cfg, shapes, hw, stage, True) + update_terms(cfg, shapes, hw, stage, batch)
    phases.append(Phase("update", tuple(terms)))
    return tuple(phases)


def needs_reference_pass(cfg: Config, stage: str) -> bool:
    """DPO/KTO reference log-probs computed in one pass before training (a full
    reference loaded for it unless LoRA; simpo and orpo have no reference)."""
    if stage == "dpo" and cfg.dpo.loss_type in ("simpo", "orpo"):
        return False
    return getattr(cfg, stage).reference_logprobs == "precompute" and not cfg.lora.enabled
