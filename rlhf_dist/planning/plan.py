"""The memory plan of a run: the per-rank peak of each phase and the terms that make it up.

`build_plan(cfg, stage, shapes, hardware)` turns a frozen Config, the architecture numbers
of its models (`memory.ModelShape`, read by `shapes.py`) and the machine (`Hardware`) into
a `Plan`: one `Phase` per part of the stage (PPO: generation, scoring, update; DPO/KTO with
a precomputed reference: reference pass, update; SFT and RM: update), each a list of named
byte terms. Torch-free: a 70B model is planned in milliseconds. The arithmetic of each term
is in `memory.py`; this module decides which terms a configuration has.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlhf_dist.config import Config, sizes
from rlhf_dist.planning import memory as mem
from rlhf_dist.planning.memory import GIB, ModelShape, VisionShape

# What the CUDA context, cuBLAS workspaces and the caching allocator's fragmentation take
# besides tensors: the plan must fit in the device's memory minus this.
DEVICE_RESERVE = 1 * GIB
# distributed.frozen_models=auto and perf.gather_for_training=auto replicate / gather a
# model when one copy takes at most this share of the device (distributed/inference.py).
AUTO_COPY_SHARE = 0.25


@dataclass(frozen=True)
class Hardware:
    """Where the run goes: `gpus` ranks with `memory` bytes each, the DeepSpeed ZeRO stage
    of the launch config (None: no DeepSpeed), its offload (none, optimizer, all), the
    device kind (cuda; cpu for the CPU validation, where dtype auto means fp32) and
    whether the launch config is FSDP2's (`fsdp2`: zero_stage None; offload none or all,
    fsdp_offload_params)."""

    gpus: int = 1
    memory: float = 80 * GIB
    zero_stage: int | None = None
    offload: str = "none"
    device: str = "cuda"
    fsdp2: bool = False

    @property
    def sharded(self) -> bool:
        """Weights sharded over the ranks and gathered unit by unit: ZeRO-3 or FSDP2."""
        return self.zero_stage == 3 or self.fsdp2

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
    vision: VisionShape | None = None  # the policy's vision tower and projector

    def policy_params(self) -> int:
        """The policy's whole weights: its language model and any vision tower."""
        return self.policy.lm_params() + (self.vision.params if self.vision else 0)


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
    autocast = hw.zero_stage is None and not hw.fsdp2 and b < mem.FP32
    return Precision(b, mem.DTYPE_BYTES[frozen], b, autocast)


def attention_kind(cfg: Config, hw: Hardware) -> str:
    """What the attention kernel keeps (memory.layer_activation_elements): eager's
    probabilities, or a fused kernel's (sdpa, flash_attention_2) log-sum-exp."""
    return "eager" if cfg.model.attn_implementation == "eager" else "fused"


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


def trained_params(cfg: Config, shapes: Shapes, stage: str, pr: Precision) -> tuple[float, float]:
    """(trained parameters, bytes of the frozen part) of the module `stage` trains: the
    policy (SFT, DPO, KTO, PPO's actor), the reward model (RM), and PPO's critic when its
    estimator needs one (one engine, one optimizer for actor + critic); with LoRA the
    adapters are trained and the base is frozen."""
    lora = cfg.lora.enabled and stage in ("sft", "ppo", "dpo", "kto")
    if stage == "rm":
        trainable, frozen = float((shapes.reward or shapes.policy).scorer_params()), 0.0
    elif lora:
        trainable = float(shapes.policy.lora_params(cfg.lora.r, cfg.lora.target_modules))
        frozen = lora_base_bytes(cfg, shapes.policy, pr)
    else:
        trainable, frozen = float(shapes.policy.lm_params()), 0.0
    if shapes.vision is not None and stage != "rm":
        extra, bytes_each = vision_weights(cfg, shapes.vision, pr, lora)
        trainable, frozen = trainable + extra, frozen + shapes.vision.params * bytes_each
    if stage == "ppo" and sizes.has_critic(cfg):
        critic = critic_shape(cfg, shapes)
        if cfg.lora.enabled and cfg.lora.critic:
            trainable += critic.lora_params(cfg.lora.r, cfg.lora.target_modules) + critic.hidden
            frozen += critic.scorer_params() * pr.compute
        else:
            trainable += critic.scorer_params()
    return trainable, frozen


def vision_weights(cfg: Config, vision: VisionShape, pr: Precision, lora: bool) -> tuple[int, float]:  # fmt: skip
    """(trained parameters, bytes per frozen parameter) of a vision tower and projector:
    trained with model.freeze_vision=false (not with LoRA, whose adapters are on the
    language model only); frozen ones hold weights only (no gradients, no optimizer
    states) in the dtype the model loads in: a LoRA base's compute dtype, fp32 under
    autocast (trained weights stay fp32 without DeepSpeed), else the weights' dtype."""
    if not cfg.model.freeze_vision and not lora:
        return vision.params, 0.0
    return 0, pr.compute if lora else (mem.FP32 if pr.autocast else pr.weights)


def trained_states(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> mem.ModelStates:
    """Weights, gradients and optimizer states of the trained module (`trained_params`)."""
    pr = precision(cfg, hw)
    trainable, frozen = trained_params(cfg, shapes, stage, pr)
    if hw.fsdp2:  # fully_shard holds every parameter, a LoRA base too, as fp32 shards
        return mem.fsdp2_states(trainable, frozen * mem.FP32 / pr.compute, hw.gpus, hw.offload)
    hidden = max(m.hidden for m in (shapes.policy, shapes.reward) if m is not None)
    bucket = sizes.zero_reduce_bucket(hidden, int(trainable)) if hw.zero_stage == 3 else 0.0
    return mem.model_states(
        trainable, frozen, pr.weights, hw.zero_stage, hw.gpus, hw.offload, bucket
    )


def critic_shape(cfg: Config, shapes: Shapes) -> ModelShape:
    """The critic starts from the reward model (ppo.critic_init=reward) or the policy."""
    if cfg.ppo.critic_init == "reward" and shapes.reward is not None:
        return shapes.reward
    return shapes.policy


def frozen_models(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> list[tuple[str, float]]:
    """Bytes per rank of each frozen model `stage` keeps resident, by the trainer's rules
    (config/sizes.py): PPO's reference (needs_reference, not LoRA: adapters off), reward
    model (no text rewards; not where the LoRA critic's base is it,
    shares_reward_with_critic) and teacher; DPO/KTO's reference when computed online (not
    LoRA; simpo and orpo use none). Partitioned over the ranks under ZeRO-3 when
    distributed.frozen_models says so (auto: when a copy exceeds a quarter of the
    device), nothing on the device when offloaded."""
    pr = precision(cfg, hw)
    models: list[tuple[str, float]] = []
    if stage == "ppo":
        if sizes.needs_reference(cfg) and not cfg.lora.enabled:
            models.append(("reference", shapes.policy_params()))
        critic_base = sizes.shares_reward_with_critic(cfg)
        if not cfg.reward.text_rewards() and shapes.reward is not None and not critic_base:
            models.append(("reward model", shapes.reward.scorer_params()))
        if shapes.teacher is not None:
            models.append(("teacher", shapes.teacher.lm_params()))
    elif stage in ("dpo", "kto") and uses_online_reference(cfg, stage):
        models.append(("reference", shapes.policy_params()))
    return [(name, frozen_share(cfg, hw, n * pr.frozen)) for name, n in models]


def uses_online_reference(cfg: Config, stage: str) -> bool:
    """A full reference model resident during DPO/KTO training: online reference
    log-probs, a reference-based loss, no LoRA (whose reference is the adapters-off base)."""
    return sizes.online_reference(cfg, stage) and not cfg.lora.enabled


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


def resident(cfg: Config, shapes: Shapes, hw: Hardware, stage: str, grads: bool) -> list:
    """What a phase holds throughout: the trained states (gradients only when `grads`:
    DeepSpeed keeps its gradient partitions; without it, FSDP2 included, they exist from
    the first micro-batch's backward to zero_grad(set_to_none)) and the frozen models."""
    s = trained_states(cfg, shapes, hw, stage)
    terms = [("weights", s.params), ("optimizer states", s.optimizer)]
    if grads:
        terms.insert(1, ("gradients", s.grads))
    return terms + [(name, b) for name, b in frozen_models(cfg, shapes, hw, stage) if b]


@dataclass(frozen=True)
class Batch:
    """One forward/backward pass: `sequences` of `length` tokens, `scored` of them
    through the output head per sequence; `accumulates`: a step has several such passes
    (so gradients exist through every pass but the first); `prompts`: PPO's distinct
    prompts whose first length - scored columns the forward runs once (`update_prompts`)."""

    sequences: float
    length: int
    scored: int
    accumulates: bool
    prompts: float = 0.0  # distinct prompts run once for all their rows (0: whole rows)


def update_phase(cfg: Config, shapes: Shapes, hw: Hardware, stage: str, batch: Batch) -> list:
    """The update's peak per rank: the resident states, then one micro-batch's forward and
    backward. Backward starts at the head, with every kept activation alive, the head's
    chunks and its weight gradient; with checkpointing a recomputed layer and its
    gradients may be larger. Without DeepSpeed and with one pass per step, gradients then
    grow while activations are freed: the peak is the larger of the two moments."""
    grads_resident = hw.zero_stage is not None or batch.accumulates
    terms = resident(cfg, shapes, hw, stage, grads_resident)
    early = activation_terms(cfg, shapes, hw, stage, batch, grads_resident)
    terms += early
    if not grads_resident:
        grads = trained_states(cfg, shapes, hw, stage).grads
        model, pr = _trained_shape(cfg, shapes, stage), precision(cfg, hw)
        rows = batch.sequences / cfg.distributed.sequence_parallel_size  # this rank's share
        late = grads + mem.backward_workspace(model, rows, batch.length, pr.compute)
        extra = max(0.0, late - sum(b for _, b in early))
        terms.append(("gradients (as activations are freed)", extra))
    return terms + extra_update_copies(cfg, shapes, hw, stage)


def _trained_shape(cfg: Config, shapes: Shapes, stage: str) -> ModelShape:
    return (shapes.reward or shapes.policy) if stage == "rm" else shapes.policy


def activation_terms(cfg: Config, shapes: Shapes, hw: Hardware, stage: str, batch: Batch, grads_resident: bool) -> list:  # fmt: skip
    """One micro-batch's kept activations (PPO's critic runs in the same backward) and the
    larger transient of backward's start: the head's chunks (+ its weight gradient when
    gradients are not resident yet) or, with checkpointing, a recomputed layer. With
    sequence parallelism each term counts this rank's 1/n of the positions, plus the
    exchanged heads and the whole-row mask (`memory.sequence_parallel_buffers`)."""
    pr, ckpt, attn = precision(cfg, hw), checkpointing(cfg, hw), attention_kind(cfg, hw)
    lora_r = cfg.lora.r if cfg.lora.enabled and stage in ("sft", "ppo", "dpo", "kto") else 0
    model = _trained_shape(cfg, shapes, stage)
    # distributed.sequence_parallel_size = n: each rank holds 1/n of every row's positions
    n = cfg.distributed.sequence_parallel_size
    b, s = batch.sequences / n, batch.length
    kept = mem.kept_activations(model, b, s, pr.compute, attn, ckpt, lora_r)
    if batch.prompts:  # each distinct prompt once, then the responses over its KV cache
        P = s - batch.scored
        kept = mem.shared_prompt_activations(model, b, batch.prompts, P, batch.scored, pr.compute, attn, lora_r)  # fmt: skip
    terms = [("activations", kept)]
    if model.moe_layers and cfg.model.router_aux_loss_coef != 0:  # null: the model's, > 0
        terms.append(("router logits (MoE balance loss)", mem.router_logits_kept(model, b * s, pr.compute)))  # fmt: skip
    if n > 1:
        # rollouts' prompts are left-padded, packed rows need their blocks: a (s, s) mask
        mask = stage == "ppo" or cfg.perf.packed_sequences
        ulysses = mem.sequence_parallel_buffers(model, batch.sequences, s, n, pr.compute, ckpt, mask)  # fmt: skip
        terms.append(("sequence-parallel exchange" + (" + row mask" if mask else ""), ulysses))
    if stage == "ppo" and sizes.has_critic(cfg):
        critic = critic_shape(cfg, shapes)
        terms.append(("critic activations", mem.kept_activations(critic, b, s, pr.compute, attn, ckpt)))  # fmt: skip
    head = 0.0
    if stage != "rm":
        head = mem.head_bytes(model, int(b * batch.scored), cfg.perf.logprob_chunk_tokens, True, pr.compute, pr.autocast)  # fmt: skip
        head *= 2 if head_as_module(cfg, shapes, hw, stage) and cfg.perf.logprob_chunk_tokens else 1
        if not grads_resident and not lora_r and not model.tied:
            head += model.vocab * model.hidden * mem.FP32
    layer = mem.backward_workspace(model, b, s, pr.compute)
    if ckpt:
        layer += mem.recomputed_layer(model, b, s, pr.compute, attn)
    name = "logits chunks (head backward)" if head >= layer else "recomputed layer + its gradients"
    terms.append((name, max(head, layer)))
    if shapes.vision is not None and stage != "rm":
        terms += vision_terms(cfg, shapes.vision, hw, b, lora_r > 0, sum(x for _, x in terms))
    return terms


def vision_terms(cfg: Config, vision: VisionShape, hw: Hardware, rows: float, lora: bool, rest: float) -> list:  # fmt: skip
    """The vision tower's part of a micro-batch of `rows` sequences of
    data.images_per_row images each (memory.vision_activations). A trained tower's
    activations are kept to backward with the rest; a frozen one's forward runs before
    the language model's and is gone before backward, so it counts only by how much it
    exceeds the `rest` of the micro-batch's peak."""
    pr, attn = precision(cfg, hw), attention_kind(cfg, hw)
    trained = not cfg.model.freeze_vision and not lora
    images = rows * cfg.data.images_per_row
    nbytes = mem.vision_activations(vision, images, pr.compute, attn, trained, checkpointing(cfg, hw))  # fmt: skip
    if trained:
        return [("vision tower activations", nbytes)]
    return [("vision tower forward (frozen)", max(0.0, nbytes - rest))]


def extra_update_copies(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> list:
    """autocast's bf16 copies of the trained linears (`autocast_copies`; saved for
    backward, none kept under checkpointing, which recasts layer by layer), ZeRO-3's
    whole-model gather per step (perf.gather_for_training)."""
    pr, model = precision(cfg, hw), _trained_shape(cfg, shapes, stage)
    lora = cfg.lora.enabled and stage in ("sft", "ppo", "dpo", "kto")
    terms = []
    if not checkpointing(cfg, hw):  # checkpointing recasts layer by layer: no copies kept
        if stage == "ppo":
            terms += autocast_copies(cfg, shapes, hw, actor=True, critic=True)
        elif pr.autocast and not lora:
            terms.append(("bf16 weight copies (autocast)", pr.compute * model.all_linear_params()))  # fmt: skip
    if hw.fsdp2:  # a LoRA base has no gradients: only the adapters' (negligible) are unsharded
        return terms + [fsdp2_units(cfg, shapes, hw, stage, training=not lora)]
    copy = trained_copy(cfg, shapes, hw, stage)
    if hw.zero_stage == 3 and gathers_for_training(cfg, hw, copy):
        terms.append(("gathered weights (ZeRO-3)", copy))
    elif hw.zero_stage == 3:
        terms.append(live_weights(model, pr.compute))
    return terms


def fsdp2_units(cfg: Config, shapes: Shapes, hw: Hardware, stage: str, training: bool) -> tuple[str, float]:  # fmt: skip
    """FSDP2's gathered units during a layer-by-layer pass (memory.fsdp2_gathered): the
    root unit of the trained module (PPO's critic's too) and two decoder layers, with
    `training` one layer's unsharded gradients as well."""
    model, pr = _trained_shape(cfg, shapes, stage), precision(cfg, hw)
    roots = [model] + ([critic_shape(cfg, shapes)] if stage == "ppo" and sizes.has_critic(cfg) else [])  # fmt: skip
    root = sum(m.lm_params() - m.all_layer_params() for m in roots)
    return ("gathered units (FSDP2)", mem.fsdp2_gathered(model, pr.compute, root, training))


def autocast_copies(cfg: Config, shapes: Shapes, hw: Hardware, actor: bool, critic: bool) -> list:  # fmt: skip
    """PPO's bf16 copies of trained fp32 linears under autocast (no DeepSpeed, bf16 asked
    for): torch's autocast caches the cast of each weight that requires grad until the
    outermost region exits. The rollout is one region (trainers/ppo.py sample_rollout),
    so the actor's copies made while sampling stay through scoring, joined there by the
    critic's; in the update each forward's copies are saved for backward. A LoRA base
    (and lora.critic's) is already 16-bit; the adapters' copies are negligible. Measured
    on an H200 (docs/benchmarks.md): without these terms the 0.47B plain cell's rollout
    was planned 14% and its update 9% under the peak."""
    pr = precision(cfg, hw)
    if not pr.autocast:
        return []
    count = 0
    if actor and not cfg.lora.enabled:
        count += shapes.policy.all_linear_params()
    if critic and sizes.has_critic(cfg) and not (cfg.lora.enabled and cfg.lora.critic):
        model = critic_shape(cfg, shapes)
        count += model.all_linear_params()
    return [("bf16 weight copies (autocast)", count * pr.compute)] if count else []


def trained_copy(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> float:
    """Bytes of one whole copy of the trained module's weights (what ZeRO-3 gathers)."""
    pr = precision(cfg, hw)
    trainable, frozen = trained_params(cfg, shapes, stage, pr)
    return trainable * pr.weights + frozen


def head_as_module(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> bool:
    """Whether the update calls the output head as a module per chunk (engine/forward.py
    head_logprobs): its weight fetched layer by layer under ZeRO-3 (not gathered for
    training). Each checkpointed chunk's backward then holds four (C, V) fp32 tensors
    (logits, log-softmax, their gradients), not the fused path's two."""
    whole = gathers_for_training(cfg, hw, trained_copy(cfg, shapes, hw, stage))
    return hw.zero_stage == 3 and not whole


# DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance (elements): ZeRO-3
# keeps a fetched weight until this many others were fetched after it, so a forward's
# weights live on into the backward that reuses them (and across a decode loop's steps).
ZERO3_LIVE_PARAMETERS = 1e9


def live_weights(model: ModelShape, weight_bytes: float) -> tuple[str, float]:
    """ZeRO-3 fetching layer by layer: the whole weights it keeps fetched at once, up to
    stage3_max_live_parameters (measured on 2 CPU ranks: the whole small model stays
    fetched from the forward through the backward, launch/bench/memory.py plan-zero3)."""
    # a MoE layer's sparse block is one leaf (models/moe.py): fetched whole, all E
    # experts at once, even past the live limit
    limit = ZERO3_LIVE_PARAMETERS + model.sparse_block_params() * bool(model.moe_layers)
    live = min(float(model.lm_params()), limit) * weight_bytes
    return ("fetched weights (ZeRO-3)", live)


def gathers_for_training(cfg: Config, hw: Hardware, copy: float) -> bool:
    """perf.gather_for_training: always, never, or auto (a `copy` of the trained module
    within a quarter of the device)."""
    mode = cfg.perf.gather_for_training
    if mode == "auto":
        return copy <= AUTO_COPY_SHARE * hw.budget
    return mode == "always"


def generation_terms(cfg: Config, shapes: Shapes, hw: Hardware, rows: int) -> list:
    """PPO's sampling of `rows` sequences at once: vLLM's reserved share of the device, or
    our decode loop's peak, the larger of the prefill's layer and the full KV cache with
    the last step's sampling tensors; under ZeRO-3 the gathered actor
    (perf.gather_for_generation) or the weights its per-layer fetches keep; with LoRA the
    merged copies of the adapted weights the rollout generates with (not QLoRA, not
    through ZeRO-3's per-layer fetches)."""
    pr, g = precision(cfg, hw), cfg.generation
    p, t = cfg.data.max_prompt_length, g.max_new_tokens
    actor = shapes.policy
    if g.backend == "vllm":
        terms = [vllm_share(cfg, shapes, hw)]
    else:
        # perf.shared_prompt_forward: each distinct prompt's prefill runs once (GRPO's n
        # samples of a prompt), not under checkpointing (engine/forward.py shares_prompts)
        shared = cfg.perf.shared_prompt_forward and not checkpointing(cfg, hw)
        prompts = -(-rows // cfg.ppo.samples_per_prompt) if shared else rows
        prefill = mem.inference_forward(actor, prompts, p, pr.compute, attention_kind(cfg, hw))
        cache = mem.kv_cache(actor, rows, p + t, pr.compute) + mem.sampling_workspace(actor, rows)
        if shapes.vision is not None:  # the prefill's images run through the tower first
            images = prompts * cfg.data.images_per_row
            tower = mem.vision_activations(shapes.vision, images, pr.compute, attention_kind(cfg, hw), False, False)  # fmt: skip
            prefill = max(prefill, tower)
        terms = [("prefill" if prefill > cache else "KV cache + sampling", max(prefill, cache))]
    if hw.sharded and cfg.perf.gather_for_generation:
        terms += gathered_actor(cfg, shapes, hw)
    elif hw.fsdp2 and g.backend == "hf":  # the root unit whole, the layers one by one
        terms.append(fsdp2_units(cfg, shapes, hw, "ppo", training=False))
        root = actor.lm_params() - actor.all_layer_params()
        first = mem.fsdp2_root_gather(root, pr.compute, sum(b for _, b in terms))
        terms.append(("the root unit's first all-gather (FSDP2)", first))
    elif hw.zero_stage == 3 and g.backend == "hf":
        terms.append(live_weights(actor, pr.compute))
    # LoRA generates with the adapters merged into copies of the adapted weights (whole
    # weights only: not through ZeRO-3's per-layer fetches; QLoRA's 4-bit ones never)
    whole = not hw.sharded or cfg.perf.gather_for_generation
    if cfg.lora.enabled and g.backend == "hf" and whole and not cfg.lora.load_in_4bit:
        terms.append(("merged LoRA weights", actor.quantizable_params() * pr.compute))
    return terms + autocast_copies(cfg, shapes, hw, actor=g.backend == "hf", critic=False)


def vllm_share(cfg: Config, shapes: Shapes, hw: Hardware) -> tuple[str, float]:
    """What one in-process vLLM engine per rank reserves: its share of the device
    (generation.vllm_gpu_memory_utilization), or more when the actor's whole weights
    alone exceed it (each rank's engine holds a full copy; it would not start)."""
    share = cfg.generation.vllm_gpu_memory_utilization * hw.memory
    weights = shapes.policy_params() * precision(cfg, hw).compute
    if weights > share:
        return ("vLLM engine (the actor's weights exceed its share)", weights)
    return ("vLLM engine share", share)


def scoring_terms(cfg: Config, shapes: Shapes, hw: Hardware, rows: int) -> list:
    """Rollout scoring of `rows` sequences per forward, no gradients, one model at a time
    (actor, reference, critic, reward model, teacher): the larger of the biggest model's
    layer working set and the head's chunk workspace with the hidden states it reads.
    With sequence parallelism (n) the log-prob forwards hold 1/n of the positions and the
    whole-row mask of the left-padded rows; the reward model runs whole rows."""
    pr, attn = precision(cfg, hw), attention_kind(cfg, hw)
    s, t = cfg.data.max_prompt_length + cfg.generation.max_new_tokens, cfg.generation.max_new_tokens
    n = cfg.distributed.sequence_parallel_size
    split = [m for m in (shapes.policy, shapes.teacher) if m is not None]
    layer = max(mem.inference_forward(m, rows / n, s, pr.compute, attn) for m in split)
    if shapes.vision is not None:  # the actor's and reference's forwards run the images
        images = rows * cfg.data.images_per_row
        layer = max(layer, mem.vision_activations(shapes.vision, images, pr.compute, attn, False, False))  # fmt: skip
    if shapes.reward is not None:
        layer = max(layer, mem.inference_forward(shapes.reward, rows, s, pr.compute, attn))
    p = shapes.policy
    head = mem.head_bytes(p, max(1, rows * t // n), cfg.perf.logprob_chunk_tokens, False, pr.compute, pr.autocast)  # fmt: skip
    head += rows / n * s * p.hidden * pr.compute
    terms = [("logits chunks" if head >= layer else "layer working set", max(head, layer))]
    return terms + ([("sequence-parallel row mask", float(rows * s * s))] if n > 1 else [])


def build_plan(cfg: Config, stage: str, shapes: Shapes, hw: Hardware) -> Plan:
    """The plan of `stage` (sft, rm, ppo, dpo, kto) under `cfg` on `hw`."""
    if stage == "ppo":
        return Plan(stage, ppo_phases(cfg, shapes, hw), hw)
    return Plan(stage, step_loop_phases(cfg, shapes, hw, stage), hw)


def ppo_phases(cfg: Config, shapes: Shapes, hw: Hardware) -> tuple[Phase, ...]:
    """Generation, scoring and update of one PPO iteration, per rank. A vLLM engine that
    does not sleep keeps its share through scoring and the update too."""
    p, g = cfg.ppo, cfg.generation
    rows = min(p.rollout_micro_batch_size, sizes.rollout_sequences_per_rank(p, hw.gpus))
    minibatch = sizes.ppo_minibatch_size(p.minibatch_size, p.rollout_batch_size, p.samples_per_prompt)  # fmt: skip
    length = cfg.data.max_prompt_length + g.max_new_tokens
    micro = sizes.micro_batch_size(p.micro_batch_size, minibatch, hw.gpus)
    batch = micro_batch(micro, p.micro_batch_tokens, length, g.max_new_tokens, minibatch // hw.gpus)
    batch = replace(batch, prompts=update_prompts(cfg, shapes, hw, batch.sequences))
    awake = [vllm_share(cfg, shapes, hw)] if g.backend == "vllm" and not g.vllm_sleep else []
    base = resident(cfg, shapes, hw, "ppo", hw.zero_stage is not None)
    scoring = scoring_terms(cfg, shapes, hw, rows) if scores_a_model(cfg, shapes) else []
    # autocast's copies: the actor's from sampling (hf) or its scoring pass, the critic's
    actor_ran = g.backend == "hf" or not sizes.old_logprobs_from_update(cfg)
    copies = autocast_copies(cfg, shapes, hw, actor=actor_ran, critic=True) if scoring else []
    return (
        Phase("generation", tuple(base + generation_terms(cfg, shapes, hw, rows))),
        Phase("scoring", tuple(base + awake + gathered_actor(cfg, shapes, hw) + scoring + copies)),
        Phase("update", tuple(update_phase(cfg, shapes, hw, "ppo", batch) + awake)),
    )


def update_prompts(cfg: Config, shapes: Shapes, hw: Hardware, rows: float) -> float:
    """Distinct prompts an update micro-batch of `rows` sequences runs once
    (perf.shared_prompt_forward, engine/forward.py `shares_prompts`): at most one per row
    and the rank's prompts of the rollout (its rows are drawn from them in random order);
    0 where the update runs whole rows: gradient checkpointing, ZeRO-3's partitioned
    weights, packed rows (planned as padded ones), images, sequence parallelism, routing
    replay (models/routing.py plain_path)."""
    p = cfg.ppo
    whole = (
        not cfg.perf.shared_prompt_forward
        or checkpointing(cfg, hw)
        or hw.zero_stage == 3
        or cfg.perf.packed_sequences
        or shapes.vision is not None
        or cfg.distributed.sequence_parallel_size > 1
        or p.routing_replay != "none"
    )
    return 0.0 if whole else float(min(rows, max(1, p.rollout_batch_size // hw.gpus)))


def gathered_actor(cfg: Config, shapes: Shapes, hw: Hardware) -> list:
    """Under ZeRO-3 with perf.gather_for_generation the rollout holds the actor's whole
    weights from sampling through scoring (rollout/collect.py: one gather per rollout)."""
    if hw.sharded and cfg.perf.gather_for_generation:
        name = "gathered actor (FSDP2)" if hw.fsdp2 else "gathered actor (ZeRO-3)"
        return [(name, shapes.policy_params() * precision(cfg, hw).compute)]
    return []


def scores_a_model(cfg: Config, shapes: Shapes) -> bool:
    """Whether the rollout's scoring runs any forward: the actor's (unless its old
    log-probs come from the update, config/sizes.py), the reference's (a KL), the critic's,
    a reward model's or a teacher's."""
    return (
        not sizes.old_logprobs_from_update(cfg)
        or sizes.needs_reference(cfg)
        or sizes.has_critic(cfg)
        or (shapes.reward is not None and not cfg.reward.text_rewards())
        or shapes.teacher is not None
    )


def micro_batch(rows: int, token_budget: int, length: int, scored: int, share: int) -> Batch:
    """One pass of `rows` sequences of `length` tokens, or with a token budget as many as
    fit in it (a longer sequence alone); it accumulates when the rank's `share` of a step
    (sequences) needs more than one pass."""
    if token_budget:
        rows = max(1, token_budget // length)
    return Batch(rows, length, scored, share > rows)


def step_loop_phases(cfg: Config, shapes: Shapes, hw: Hardware, stage: str) -> tuple[Phase, ...]:
    """SFT, RM, DPO, KTO: the update of one micro-batch (a row is a pair for RM and DPO)
    and, for DPO/KTO with reference log-probs computed before training, that pass."""
    section = getattr(cfg, stage)
    micro = sizes.micro_batch_size(section.micro_batch_size, section.batch_size, hw.gpus)
    length, per_row = cfg.data.max_length, SEQUENCES_PER_ROW[stage]
    share = section.batch_size // hw.gpus * per_row
    batch = micro_batch(micro * per_row, section.micro_batch_tokens, length, length, share)
    rows = batch.sequences
    phases = []
    if stage in ("dpo", "kto") and needs_reference_pass(cfg, stage):
        pr = precision(cfg, hw)
        ref = frozen_share(cfg, hw, shapes.policy_params() * pr.frozen)
        forward = mem.inference_forward(shapes.policy, rows, length, pr.compute, attention_kind(cfg, hw))  # fmt: skip
        head = mem.head_bytes(shapes.policy, int(rows * length), cfg.perf.logprob_chunk_tokens, False)  # fmt: skip
        terms = resident(cfg, shapes, hw, stage, hw.zero_stage is not None)
        terms += [("reference", ref), ("forward peak", max(forward, head))]
        phases.append(Phase("reference pass", tuple(terms)))
    phases.append(Phase("update", tuple(update_phase(cfg, shapes, hw, stage, batch))))
    return tuple(phases)


def needs_reference_pass(cfg: Config, stage: str) -> bool:
    """DPO/KTO reference log-probs computed in one pass before training
    (sizes.precomputed_reference) with a full reference loaded for it (not LoRA, whose
    reference is the adapters-off base)."""
    return sizes.precomputed_reference(cfg, stage) and not cfg.lora.enabled
