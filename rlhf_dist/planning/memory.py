"""The arithmetic of the memory planner: bytes of each term of a rank's peak, from a
model's architecture numbers alone (no weights, no torch).

Every function takes numbers and returns bytes. Shapes: `h` hidden size, `L` layers, `a`
attention heads, `k` key/value heads, `d` head dim, `f` MLP intermediate size, `V`
vocabulary; a micro-batch of `b` sequences of `s` tokens (`n = b x s` tokens).

Sources: model states follow the ZeRO paper (Rajbhandari et al. 2020, section 3: 2 + 2 +
K bytes per parameter in mixed precision, K = 12 for Adam's fp32 master weights, momentum
and variance, partitioned over N ranks by stage); activation memory follows the counting
of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4.1: the tensors autograd keeps per layer per token), redone for a
Llama layer (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no dropout)
and checked against the tensors torch saves (launch/bench/memory.py plan).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30

# Bytes per element of the dtypes the config can name; nf4 is QLoRA's 4-bit base.
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "nf4": 0.5}
# QLoRA's quantisation constants: one 8-bit absmax per 64 weights, double-quantised
# (Dettmers et al. 2023, section 3: 0.127 bits per parameter), in bytes per weight.
NF4_CONSTANTS = 0.127 / 8
FP32 = 4.0


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a decoder-only transformer (Llama, Qwen, Mistral
    shapes): what the planner reads from a model's config.json."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False
    qkv_bias: bool = False
    # Mixture of experts (0: dense): `moe_layers` of the L layers replace the MLP by a
    # router (h x E) and E routed SwiGLU experts of `expert_intermediate` (f_e), each
    # token computed by `experts_per_token` (k) of them, plus shared experts of
    # `shared_intermediate` in all (every token); the other layers keep the dense MLP.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    moe_layers: int = 0

    def attention_params(self) -> int:
        """One layer's q, k, v, o weights (h x a d, 2 x h x k d, a d x h)."""
        h, ad, kd = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * ad + 2 * h * kd + ad * h

    def sparse_block_params(self) -> int:
        """One MoE layer's MLP: router (h x E), E experts (3 x h x f_e each), shared
        experts (3 x h x f_s); what ZeRO-3 fetches as one leaf module (models/moe.py)."""
        h = self.hidden
        routed = self.experts * 3 * h * self.expert_intermediate
        return h * self.experts + routed + 3 * h * self.shared_intermediate

    def linear_params(self) -> int:
        """Weights of one dense layer's linears: attention and the SwiGLU MLP's gate, up
        and down (3 x h x f)."""
        return self.attention_params() + 3 * self.hidden * self.intermediate

    def all_linear_params(self) -> int:
        """Every layer's linears: L attentions, the dense MLPs and the sparse blocks."""
        dense = (self.layers - self.moe_layers) * 3 * self.hidden * self.intermediate
        moe = self.moe_layers * self.sparse_block_params()
        return self.layers * self.attention_params() + dense + moe

    def inactive_params(self) -> int:
        """Expert weights a token does not run: (E - k) routed experts per MoE layer."""
        unused = self.experts - self.experts_per_token
        return self.moe_layers * unused * 3 * self.hidden * self.expert_intermediate

    def _layer_extras(self) -> int:
        """One layer's weights besides its linears: q/k/v biases (Qwen2), two RMSNorms."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return bias + 2 * self.hidden

    def layer_params(self) -> int:
        """The largest decoder layer (one FSDP2 unit): attention, its MLP (a sparse block
        in an MoE layer), biases and norms."""
        mlp = self.sparse_block_params() if self.moe_layers else 3 * self.hidden * self.intermediate
        return self.attention_params() + mlp + self._layer_extras()

    def all_layer_params(self) -> int:
        """The L decoder layers: every linear, bias and norm."""
        return self.all_linear_params() + self.layers * self._layer_extras()

    def backbone_params(self) -> int:
        """Embedding (V x h), the L layers and the final norm."""
        return self.vocab * self.hidden + self.all_layer_params() + self.hidden

    def lm_params(self) -> int:
        """A causal LM: the backbone and its head (V x h unless tied to the embedding)."""
        return self.backbone_params() + (0 if self.tied else self.vocab * self.hidden)

    def scorer_params(self) -> int:
        """A reward model or critic: the backbone and a (1 x h) score head."""
        return self.backbone_params() + self.hidden

    def active_params(self) -> int:
        """Parameters a token runs through (`lm_params` less `inactive_params`)."""
        return self.lm_params() - self.inactive_params()

    def quantizable_params(self) -> int:
        """What QLoRA stores in 4 bits: every layer's linears (embedding, head, norms
        stay in the compute dtype, as bitsandbytes leaves them)."""
        return self.all_linear_params()

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """LoRA adapters of rank r on the named linears of every layer: A (r x in) and
        B (out x r), r x (in + out) weights each (Hu et al. 2021)."""
        h, ad, kd, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate  # fmt: skip
        dims = {"q_proj": (h, ad), "k_proj": (h, kd), "v_proj": (h, kd), "o_proj": (ad, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}  # fmt: skip
        per_layer = sum(rank * sum(dims[t]) for t in targets if t in dims)
        return self.layers * per_layer


@dataclass(frozen=True)
class ModelStates:
    """Per-rank bytes of a trained model's states on the accelerator, and what offload
    moved to CPU memory."""

    params: float
    grads: float
    optimizer: float
    cpu: float = 0.0


# DeepSpeed's default zero_optimization.sub_group_size (elements): ZeRO-3 steps the
# optimizer one sub-group of a rank's partition at a time, with one fp32 gradient buffer
# the size of the largest.
ZERO3_SUB_GROUP = 1e9


def model_states(
    trainable: float,
    frozen: float,
    weight_bytes: float,
    zero_stage: int | None,
    world: int,
    offload: str = "none",
    bucket: float = 0.0,
) -> ModelStates:
    """Weights, gradients and AdamW states of a trained model, per rank.

    trainable: trained parameters; frozen: bytes of the model's frozen part (a LoRA base).
    Without DeepSpeed (zero_stage None) the trained weights are fp32 whatever the compute
    dtype (bf16 by autocast), so 4 + 4 + 8 bytes per parameter; several ranks under DDP
    keep one more fp32 copy of the gradients in its all-reduce buckets. Under DeepSpeed,
    ZeRO paper eq. 1: weight_bytes for weights and gradients plus K = 12 (bf16: fp32
    master, momentum, variance) or 8 (fp32: momentum, variance); stage 1 partitions the
    optimizer states over the ranks, stage 2 also the gradients, stage 3 also the
    weights (the frozen part included). ZeRO-3 (DeepSpeed's stage3.py) holds two buffers
    the paper leaves out, measured on 2 CPU ranks (launch/bench/memory.py plan-zero3): the
    fp32 gradient the optimizer steps with (4 bytes per parameter of its largest
    sub-group) and the gradient bucket backward reduces through (`bucket` elements of
    the weights' dtype, whole on every rank: config/sizes.py zero_reduce_bucket); both
    are counted with the gradients. offload: "optimizer" moves the optimizer states (and
    ZeRO-3's fp32 gradients) to CPU memory, "all" (stage 3) the weights as well.
    """
    if zero_stage is None:
        buckets = 4.0 * trainable if world > 1 else 0.0
        return ModelStates(4.0 * trainable + frozen, 4.0 * trainable + buckets, 8.0 * trainable)
    k = 8.0 if weight_bytes == FP32 else 12.0
    params = weight_bytes * trainable + frozen
    grads = weight_bytes * trainable
    optim = k * trainable
    if zero_stage >= 1:
        optim /= world
    if zero_stage >= 2:
        grads /= world
    cpu = 0.0
    if zero_stage >= 3:
        params /= world
        fp32_grads = FP32 * min(trainable / world, ZERO3_SUB_GROUP)
        if offload in ("optimizer", "all"):
            cpu, fp32_grads = cpu + FP32 * trainable / world, 0.0
        grads += fp32_grads + weight_bytes * bucket
    if offload in ("optimizer", "all"):
        cpu, optim = cpu + optim, 0.0
    if offload == "all" and zero_stage >= 3:
        cpu, params = cpu + params, 0.0
    return ModelStates(params, grads, optim, cpu)


def fsdp2_states(trainable: float, frozen: float, world: int, offload: str = "none") -> ModelStates:
    """Weights, gradients and AdamW states of a model sharded by FSDP2
    (distributed/fsdp2.py), per rank. Every parameter, frozen ones (a LoRA base) included,
    is an fp32 DTensor shard (Shard(0), 1/world of it): under bf16 the shards are the
    fp32 master weights and the bf16 copies exist only while a unit is gathered
    (`fsdp2_gathered`). `frozen` is the frozen part's fp32 bytes. Gradients are sharded
    fp32 (reduced in fp32), AdamW's momentum and variance fp32 shards: 4 + 4 + 8 bytes per
    trained parameter over `world`, ZeRO-3's 16 bytes without its buffers. offload "all"
    (fsdp_offload_params, CPUOffloadPolicy) keeps all three in CPU memory."""
    params = (FP32 * trainable + frozen) / world
    grads, optim = FP32 * trainable / world, 2 * FP32 * trainable / world
    if offload == "all":
        return ModelStates(0.0, 0.0, 0.0, params + grads + optim)
    return ModelStates(params, grads, optim)


def fsdp2_gathered(shape: ModelShape, compute_bytes: float, root_params: float, training: bool) -> float:  # fmt: skip
    """What FSDP2 holds whole besides the shards while a pass runs layer by layer: the
    root unit (embedding, final norm, head; `root_params`, kept gathered from its forward
    through its backward) and two decoder-layer units in the compute dtype (the one
    running and the next, which FSDP2 prefetches); in backward also one layer's unsharded
    gradient in the compute dtype and its fp32 copy for the reduce-scatter."""
    layer = shape.layer_params()
    gathered = (root_params + 2 * layer) * compute_bytes
    return gathered + (layer * (compute_bytes + FP32) if training else 0.0)


def fsdp2_root_gather(root_params: float, compute_bytes: float, rest: float) -> float:
    """A no-grad pass's first all-gather of the root unit (generation's first decode step;
    the root then stays gathered, not resharded after its forward): the all-gather's
    output and the unsharded copy filled from it, 2 x root in the compute dtype, while no
    layer is gathered and no KV cache exists yet. Counted by how much it exceeds `rest`,
    the pass's other transients (the root with two layers, the prefill or KV cache)."""
    return max(0.0, 2 * root_params * compute_bytes - rest)


def frozen_weights(params: float, weight_bytes: float, partitioned_over: int) -> float:
    """A frozen (inference-only) model's weights on one rank: bytes per weight x params,
    divided over the ranks when partitioned like ZeRO-3 (1: replicated)."""
    return params * weight_bytes / partitioned_over


def layer_activation_elements(shape: ModelShape, seq_len: int, attention: str) -> float:
    """Elements autograd keeps per token for one Llama layer's backward (no recompute).

    Counted as Korthikanti et al. 2022, section 4.1, for a pre-norm Llama layer:
    - each RMSNorm: its input x, the normalised x and the weighted output (3h), twice;
    - the attention: rotary q (ad = h for Llama shapes) and k, v expanded to all heads
      (2h; grouped-query k, v are copied per query head), the un-expanded rotary k and
      v (2kd) and the attention output before o_proj (h): 4h + 2kd;
    - the SwiGLU MLP: gate and up outputs, silu(gate) and their product (4f);
    - what the attention kernel keeps besides: eager the softmax probabilities (a x s
      per token), fused kernels (sdpa, flash) a log-sum-exp per head (a).
    Total 10h + 2kd + 4f + the attention term.
    """
    h, kd = shape.hidden, shape.kv_heads * shape.head_dim
    attn = shape.heads * seq_len if attention == "eager" else shape.heads
    return 10 * h + 2 * kd + 4 * shape.intermediate + attn


def sparse_layer_elements(shape: ModelShape, seq_len: int, attention: str) -> float:
    """`layer_activation_elements` of a MoE layer: its dense MLP's 4f replaced by each of
    the token's k experts' SwiGLU tensors (4 f_e) and its copies of the token in and out
    of the expert (2h), the shared experts' 4 f_s, and the router's logits and softmax
    (2E)."""
    dense = layer_activation_elements(shape, seq_len, attention) - 4 * shape.intermediate
    k = shape.experts_per_token
    experts = k * (4 * shape.expert_intermediate + 2 * shape.hidden)
    return dense + experts + 4 * shape.shared_intermediate + 2 * shape.experts


def router_logits_kept(shape: ModelShape, tokens: float, act_bytes: float) -> float:
    """The load-balancing loss's router logits (model.router_aux_loss_coef > 0,
    trainers/moe_aux.py): each MoE layer's (n, E) logits and their fp32 softmax, kept to
    the micro-batch's backward whatever the checkpointing."""
    return tokens * shape.moe_layers * shape.experts * (act_bytes + FP32)


def kept_activations(
    shape: ModelShape,
    batch: float,
    seq_len: int,
    act_bytes: float,
    attention: str,
    checkpointing: bool,
    lora_rank: int = 0,
    attended: int = 0,
) -> float:
    """Bytes kept from forward to backward for one micro-batch of `batch` sequences of
    `seq_len` tokens (n = b x s), each attending over `attended` keys (0: `seq_len`; a
    forward over a KV cache attends over more): L layers of `layer_activation_elements`
    each, or with checkpointing (non-reentrant, per layer) only each layer's input, h per token
    (Korthikanti et al. 2022, section 5, full recomputation); with LoRA each adapted
    linear's (n, r) intermediate (7 per layer at most); and the final norm's 3h plus the
    scored positions' hidden states gathered for the head (h): 4h per token.

    LoRA's base is frozen, and autograd keeps a tensor only for a gradient that is needed:
    no RMSNorm keeps its normalised x for its (frozen) weight's gradient (h less for each
    of the 2L + 1 norms), and the first layer's input (the frozen embedding's output) needs
    no gradient, so its input norm keeps nothing (h less again): (2L + 2)h per token."""
    keys = attended or seq_len
    dense = layer_activation_elements(shape, keys, attention)
    sparse = sparse_layer_elements(shape, keys, attention) if shape.moe_layers else 0.0
    kept = (shape.layers - shape.moe_layers) * dense + shape.moe_layers * sparse
    frozen_norms = (2 * shape.layers + 2) * shape.hidden if lora_rank else 0
    if checkpointing:  # the layers keep only their inputs; the final norm still its x
        kept, frozen_norms = shape.layers * shape.hidden, shape.hidden if lora_rank else 0
    per_token = kept - frozen_norms + shape.layers * 7 * lora_rank + 4 * shape.hidden
    return batch * seq_len * per_token * act_bytes


def shared_prompt_activations(
    shape: ModelShape, rows: float, prompts: float, prompt_len: int, response_len: int,
    act_bytes: float, attention: str, lora_rank: int = 0,
) -> float:  # fmt: skip
    """Bytes kept for backward by an update forward that runs each distinct prompt once
    (perf.shared_prompt_forward; engine/forward.py `_shared_prompt_forward`): the `prompts`
    (u) distinct prompts of P tokens with a KV cache, then the `rows` (b) responses of T
    tokens over that cache. Both forwards keep `kept_activations` per token (u x P + b x T
    tokens, not b x (P + T)); the responses' forward keeps besides, in each of the L
    layers, the keys and values of every row's P cached positions expanded to all a heads
    (a cache brings an attention mask, and with a mask transformers' sdpa path attends over
    repeat_kv's copies): 2 x L x b x P x a d; and that (b, 1, T, P + T) additive mask in
    the compute dtype, one for all layers."""
    context = prompt_len + response_len
    prompt = kept_activations(shape, prompts, prompt_len, act_bytes, attention, False, lora_rank)
    response = kept_activations(
        shape, rows, response_len, act_bytes, attention, False, lora_rank, context
    )
    cached = 2 * shape.layers * rows * prompt_len * shape.heads * shape.head_dim
    mask = rows * response_len * context
    return prompt + response + (cached + mask) * act_bytes


def sequence_parallel_buffers(
    shape: ModelShape, batch: float, seq_len: int, n: int, act_bytes: float,
    checkpointing: bool, row_mask: bool,
) -> float:  # fmt: skip
    """What Ulysses sequence parallelism (distributed.sequence_parallel_size = n) adds per
    rank to a micro-batch of `batch` rows of `seq_len` positions, 1/n of them here: each
    layer's attention keeps the all-to-all's outputs, q and k, v for the whole row and h/n
    heads (h + 2kd elements per local position; with checkpointing only the layer being
    recomputed), and with `row_mask` (left-padded or packed rows) the whole-row
    (rows, 1, s, s) bool mask that every rank builds once (engine/sequence_parallel.py;
    right-padded rows attend causally without one)."""
    kd = shape.kv_heads * shape.head_dim
    layers = 1 if checkpointing else shape.layers
    exchanged = layers * batch * seq_len / n * (shape.hidden + 2 * kd) * act_bytes
    return exchanged + (batch * seq_len * seq_len if row_mask else 0.0)


def recomputed_layer(shape: ModelShape, batch: float, seq_len: int, act_bytes: float, attention: str) -> float:  # fmt: skip
    """With checkpointing, the one layer whose activations backward recomputes at a time."""
    one = layer_activation_elements(shape, seq_len, attention)
    if shape.moe_layers:
        one = max(one, sparse_layer_elements(shape, seq_len, attention))
    return batch * seq_len * one * act_bytes


def backward_workspace(shape: ModelShape, batch: float, seq_len: int, act_bytes: float) -> float:
    """Transient gradients in backward: the gradient of one layer's input and of its
    largest intermediates (the MLP's gate/up/product gradients, 3f, plus the residual
    stream's h twice) for the micro-batch's n tokens."""
    f = shape.intermediate
    if shape.moe_layers:  # a MoE layer: its k experts' and shared experts' intermediates
        f = max(f, shape.experts_per_token * shape.expert_intermediate + shape.shared_intermediate)
    return batch * seq_len * (3 * f + 2 * shape.hidden) * act_bytes


def head_bytes(
    shape: ModelShape, tokens: int, chunk_tokens: int, training: bool,
    compute_bytes: float = FP32, cast_head: bool = False,
) -> float:  # fmt: skip
    """The output head's logits memory (fp32 (tokens, V) blocks).

    Chunked (perf.logprob_chunk_tokens = C > 0): the one (2, C, V) fp32 workspace the
    chunks share, forward and (logits recomputed) backward alike; a 16-bit head
    (`compute_bytes` < 4) also makes each chunk's (C, V) logits in its own dtype before
    they are upcast into the workspace, and under autocast (`cast_head`) the (V, h) head
    is cast once per pass (algo/logprobs.py). Whole (C = 0): the (n, V) logits and their
    log-softmax, and in training the gradients of both: 2 (no grad) or 4 (n, V) fp32
    tensors at once.
    """
    v = shape.vocab
    if chunk_tokens > 0:
        c = min(chunk_tokens, tokens)
        low = compute_bytes * c * v if compute_bytes < FP32 else 0.0
        return FP32 * 2 * c * v + low + (compute_bytes * v * shape.hidden if cast_head else 0.0)
    return FP32 * tokens * v * (4 if training else 2)


def inference_forward(shape: ModelShape, batch: float, seq_len: int, act_bytes: float, attention: str) -> float:  # fmt: skip
    """Peak transient memory of one layer of a no-grad forward over b x s tokens: the
    residual, the normalised input, q/k/v and the MLP's gate, up and product (5h + 2kd +
    3f per token) and, eager, the attention scores (a x s)."""
    h, kd = shape.hidden, shape.kv_heads * shape.head_dim
    attn = shape.heads * seq_len if attention == "eager" else 0
    mlp = 3 * shape.intermediate
    if shape.moe_layers:  # k experts' gate, up, product, the shared ones', the router's E
        sparse = 3 * (
            shape.experts_per_token * shape.expert_intermediate + shape.shared_intermediate
        )
        mlp = max(mlp, sparse + 2 * shape.experts)
    return batch * seq_len * (5 * h + 2 * kd + mlp + attn) * act_bytes


def kv_cache(shape: ModelShape, batch: int, tokens: int, cache_bytes: float) -> float:
    """The decode loop's KV cache: keys and values of every layer, k heads of d, for all
    `tokens` (prompt + response) of `batch` sequences: 2 x L x b x tokens x k x d."""
    return 2 * shape.layers * batch * tokens * shape.kv_heads * shape.head_dim * cache_bytes


def sampling_workspace(shape: ModelShape, batch: int) -> float:
    """One decode step's fp32 (b, V) tensors alive together: the last position's logits,
    the tempered probabilities and their cumulative sum (inverse-CDF sampling)."""
    return 3 * FP32 * batch * shape.vocab


@dataclass(frozen=True)
class VisionShape:
    """A vision-language policy's vision tower and projector (docs/vision.md "Memory
    plan"): `params` weights in all; a ViT of `layers` pre-norm layers of width `hidden`,
    `heads` heads and an MLP of `intermediate` (`gated`: SwiGLU's three linears, Qwen2.5-VL,
    else fc1 / fc2); each image takes `image_tokens` tokens of the language model's
    sequence and runs `positions` positions through the tower (LLaVA: the patches and
    CLS; Qwen2-VL: 4 patches per merged token; Gemma 3: the patches pooled to its tokens)."""

    params: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    image_tokens: int
    positions: int
    gated: bool = False

    def _mlp(self) -> int:
        """Elements of the MLP's intermediates per position: fc1's output and its GELU
        (2f), or SwiGLU's gate, up and product (3f)."""
        return (3 if self.gated else 2) * self.intermediate


def vision_layer_elements(vision: VisionShape, attention: str) -> float:
    """Elements autograd keeps per position for one ViT layer's backward (no recompute),
    counted as `layer_activation_elements` for a pre-norm layer with LayerNorm and no
    grouped heads: each LayerNorm's input and output (4h), q, k, v and the attention
    output (4h), the MLP's intermediates (2f, gated 3f), and eager attention's
    probabilities (a x positions) or a fused kernel's log-sum-exp (a): 8h + 2f + attn."""
    p = vision.positions
    attn = vision.heads * p if attention == "eager" else vision.heads
    return 8 * vision.hidden + vision._mlp() + attn


def vision_activations(
    vision: VisionShape, images: float, act_bytes: float, attention: str,
    trained: bool, checkpointing: bool,
) -> float:  # fmt: skip
    """The vision tower's memory for the `images` of one micro-batch. Frozen
    (model.freeze_vision, or not `trained`): no input needs a gradient, so autograd keeps
    nothing and the peak is one layer's forward, the residual, the normalised input, q,
    k, v and the MLP's intermediates (5h + 2f per position, gated 3f) plus eager attention's
    scores. Trained: every layer's `vision_layer_elements`, or with checkpointing each
    layer's input (h) plus the one layer backward recomputes."""
    n = images * vision.positions
    eager = vision.heads * vision.positions if attention == "eager" else 0
    one = n * (5 * vision.hidden + vision._mlp() + eager) * act_bytes
    if not trained:
        return one
    per_layer = vision_layer_elements(vision, attention)
    if checkpointing:
        return n * vision.layers * vision.hidden * act_bytes + n * per_layer * act_bytes
    return n * vision.layers * per_layer * act_bytes
