"""ZeRO-3 with fewer collectives: weights gathered whole, gradients reduced in one piece.

Under ZeRO-3 every module all-gathers its parameters in a forward hook and releases them
after its backward. A PPO micro-batch of a 24-layer actor and critic then runs ~60
all-gathers and ~1,000 hook calls, a large share of an update on CPU ranks
(docs/benchmarks.md). When one full copy of the weights fits, `whole_weights` gathers all
of them in ONE coalesced collective (an all-gather; on CPU ranks an all-reduce,
deepspeed_config.fill_gloo_zero3) and takes ZeRO-3's per-module fetch/release hooks off
for its duration. What stays partitioned: the gradients (ZeRO-3's per-parameter and
leaf-module gradient hooks stay, so gradients are still reduce-scattered into partitions
in buckets during backward) and the optimizer states (fp32 masters, Adam moments), which
are most of ZeRO-3's saving (14 of the 16 bytes per parameter of bf16 Adam training).

The peak is about ZeRO-3's own: with DeepSpeed's defaults
(`stage3_max_live_parameters` and `stage3_max_reuse_distance` 1e9) a layer fetched in the
forward is kept for its backward, so at the end of a forward every weight of a model under
~0.5B parameters is live anyway. The optimizer step updates the partitions and releases
every whole weight; the next forward of the model gathers them again (a forward pre-hook),
so one optimizer step costs one collective whatever its number of micro-batches.

Over gloo (CPU ranks) ZeRO-3's gradient reduce-scatter is also replaced by one all-reduce
of the bucket where it lies (`reduce_gradients_by_all_reduce`).

A vision-language model's tower runs only in forwards whose rows hold images; under
per-module fetching (or FSDP2's per-unit gathers) every rank must run it when any rank
does (`tower_in_step`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from rlhf_dist.distributed import fsdp2

if TYPE_CHECKING:
    import torch.distributed
    from deepspeed import DeepSpeedEngine

# Engines inside `whole_weights` now (nested uses of one engine are no-ops).
_ACTIVE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# ids of the parameters of those engines (`stays_whole`).
_WHOLE_IDS: set[int] = set()


def is_whole(engine: torch.nn.Module) -> bool:
    """Whether `engine` is inside `whole_weights` (its weights whole, fetch hooks off)."""
    return engine in _ACTIVE


def is_partitioned(module: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitions `module`'s parameters (each rank holds a slice: only the
    engine's gathers make them whole)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def whole_shape(param: torch.nn.Parameter) -> torch.Size:
    """The shape of the whole parameter: ds_shape under ZeRO-3, where a partitioned
    parameter's own shape is empty."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def stays_whole(param: torch.nn.Parameter) -> bool:
    """Whether `param` may be read as a whole tensor for the rest of a forward AND its
    backward: it is not managed by ZeRO-3 at all, or its engine is inside `whole_weights`
    (read inside the engine's forward: after an optimizer step the forward pre-hook
    gathers again). Under ZeRO-3's per-module fetching a weight is whole only while its
    module runs, so code that reads it directly (the chunked log-prob head,
    engine.forward.head_logprobs) must call the module instead. An FSDP2 shard (a DTensor
    parameter, outside fsdp2.whole_weights) is never whole."""
    zero3_whole = not hasattr(param, "ds_id") or id(param) in _WHOLE_IDS
    return zero3_whole and not fsdp2.is_sharded(param)


@contextlib.contextmanager
def whole_weights(engine: DeepSpeedEngine) -> Iterator[None]:
    """Run the body with every weight of ZeRO-3 `engine` whole on every rank.

    Entry gathers (collective: every rank enters together); after an optimizer step the
    next forward of the engine's module gathers again; exit re-partitions whatever is
    still whole and puts ZeRO-3's per-module hooks back. A nested use is a no-op.
    """
    if engine in _ACTIVE:
        yield
        return
    offload = _parameter_offload(engine)
    params = list(engine.module.parameters())
    _remove_fetch_hooks(offload)
    # Registered after DeepSpeed's own start-of-forward pre-hook (its trace reset).
    regather = engine.module.register_forward_pre_hook(lambda module, args: gather(params))
    _ACTIVE.add(engine)
    ids = {id(p) for p in params}
    _WHOLE_IDS.update(ids)
    linear = _plain_linear()
    try:
        gather(params)
        yield
    finally:
        _ACTIVE.discard(engine)
        _WHOLE_IDS.difference_update(ids)
        torch.nn.functional.linear = linear
        regather.remove()
        release(engine)
        # release_and_reset_all: waits for anything in flight, partitions what is left.
        offload.empty_partition_cache()
        offload._register_deepspeed_module(offload.module)


def whole_tensors(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each of `params` as a whole tensor, detached: itself where ZeRO-3 does not partition
    it (or holds it whole now), else a copy gathered in ONE collective (a frozen model's
    engine, distributed.frozen_models=partition; every rank must call this with the same
    list). For code that reads a frozen weight a number of times that differs between
    ranks, in the forward AND a recomputing backward (a teacher's output head, chunk by
    chunk: engine.forward.chunked_divergence), where ZeRO-3's per-call fetch would be a
    collective some ranks skip. The copy costs the weight's whole size while it lives."""
    partitioned = [p for p in params if not stays_whole(p)]
    if not partitioned:
        return [p.detach() for p in params]
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        return [p.detach().clone() if not stays_whole(p) else p.detach() for p in params]


def gather(params: list[torch.nn.Parameter]) -> None:
    """Gather every partitioned parameter of `params` in one coalesced collective
    (DeepSpeed's `all_gather_coalesced`, the call its prefetcher makes per module: one
    flat buffer, one all-gather or all-reduce). Every rank must call it with the same list."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if missing:
        missing[0].all_gather_coalesced(missing).wait()


def release(engine: DeepSpeedEngine) -> None:
    """Drop the whole copies of the weights of `engine` (inside `whole_weights`; no
    collective), as ZeRO-3's optimizer step first does itself: its release formats
    debug strings for every parameter, a cost paid on every step. The partitions are
    untouched; the next forward gathers again."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param

    for p in engine.module.parameters():
        if p.ds_status == ZeroParamStatus.AVAILABLE and _releasable(p):
            free_param(p)


def _releasable(p: torch.nn.Parameter) -> bool:
    """A whole parameter whose partition is in memory (not on NVMe), in no module's use."""
    location = getattr(p.ds_tensor, "final_location", None)
    return p.ds_tensor is not None and location is None and not p.ds_active_sub_modules


def _plain_linear() -> Callable[..., torch.Tensor]:
    """Put torch's own F.linear back for the body; returns what to restore afterwards.

    ZeRO-3 (memory_efficient_linear, on by default) replaces F.linear process-wide with
    an autograd Function that re-binds its arguments through inspect.signature on every
    call, a large share of a CPU rollout. It exists so that weights released
    between forward and backward can be fetched again; whole weights are never released
    mid-step, so torch's linear computes the same values without that cost.
    """
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    current = torch.nn.functional.linear
    torch.nn.functional.linear = getattr(
        InsertPostInitMethodToModuleSubClasses, "linear_bk", current
    )
    return current


def whole_bytes(engine: DeepSpeedEngine) -> int:
    """Bytes one full copy of the engine's weights takes (partitioned or not)."""
    return sum(p.ds_numel * p.element_size() for p in engine.module.parameters())


def _parameter_offload(engine: DeepSpeedEngine) -> Any:
    """The object holding ZeRO-3's module hooks (DeepSpeedZeRoOffload)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "parameter_offload", optimizer)


def _remove_fetch_hooks(offload: Any) -> None:
    """Take off the per-module forward/backward hooks that fetch and release parameters
    (not the gradient-reduction hooks, which live on the parameters and the leaf modules,
    nor the start-of-forward trace reset)."""
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def tower_in_step(
    model: torch.nn.Module, blank: Callable[[torch.nn.Module], Any], is_tower: Callable[[str], bool]
) -> None:
    """Make every rank run the vision tower of `model` in a forward where any rank does.

    model: a transformers vision-language model, the module whose forward takes
    `pixel_values`, embeds the input ids, runs its tower on the images (if any) and then
    its decoder (`model.get_decoder()`) on `inputs_embeds`. blank(model): the features of
    one blank image through the tower and projector (tensors, in any nesting).
    is_tower(name): whether parameter `name` of `model` is the tower's.

    Under ZeRO-3's per-module fetching (and FSDP2's per-unit gathers: Qwen-VL's vision
    blocks are units) each module's forward gathers its weights, a collective; a rank
    whose rows hold no image skips the tower while its peers gather the tower's weights,
    and the ranks hang on mismatched gathers. So at each forward the ranks agree (one
    all-reduce of a flag) whether any of them has images; one without runs `blank` just
    before its decoder, where its peers ran their towers (after the embeddings), and adds
    0 x the features' sum to the decoder's `inputs_embeds`, so that a trained tower's
    backward runs on every rank too (0 x a finite sum: the embeddings are unchanged).
    While the tower's weights are whole (one process, a gathered rollout or training
    step, `whole_weights`, fsdp2.whole_weights) it does nothing: ranks then run their
    forwards independently and no collective may be added."""
    hook = functools.partial(_before_forward, blank, is_tower)
    model.register_forward_pre_hook(hook, with_kwargs=True)


def _before_forward(
    blank: Callable[[torch.nn.Module], Any],
    is_tower: Callable[[str], bool],
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
) -> None:
    """`tower_in_step`'s pre-hook on the model: a one-shot pre-hook on its decoder that
    runs the blank image when another rank's forward has images and this one's has not."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    # any: under FSDP2 the tower's patch embedding and merger sit in the root unit, whole
    # at this point, and only its blocks (units of their own) are gathered per forward
    tower = (p for name, p in model.named_parameters() if is_tower(name))
    if all(stays_whole(p) for p in tower):  # unsharded, or whole now
        return
    ids = kwargs.get("input_ids")
    device = ids.device if ids is not None else kwargs["inputs_embeds"].device
    mine = kwargs.get("pixel_values") is not None
    flag = torch.tensor([float(mine)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if mine or not flag.item():
        return
    handles: list[torch.utils.hooks.RemovableHandle] = []
    hook = functools.partial(_blank_before_decoder, blank, model, handles)
    # first among the decoder's pre-hooks: before ZeRO-3's fetch hook records the decoder
    # in its module trace, which must be the same on every rank (tower, then decoder)
    decoder = model.get_decoder()
    handles.append(decoder.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))


def _blank_before_decoder(
    blank: Callable[[torch.nn.Module], Any],
    model: torch.nn.Module,
    handles: list[torch.utils.hooks.RemovableHandle],
    decoder: torch.nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
) -> tuple[tuple, dict[str, Any]]:
    """Run once: the blank image through the tower, its features' sum x 0 added to the
    decoder's `inputs_embeds` (B, L, H) when the call names them."""
    handles.pop().remove()
    total = sum(t.float().sum() for t in _tensors(blank(model)))
    if kwargs.get("inputs_embeds") is not None:
        embeds = kwargs["inputs_embeds"]
        kwargs = {**kwargs, "inputs_embeds": embeds + 0 * total.to(embeds.dtype)}
    return args, kwargs


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `value`: a tensor, or lists, tuples and dicts (a transformers
    ModelOutput) of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def reduce_gradients_by_all_reduce() -> None:
    """Over a gloo process group, make ZeRO-3's gradient reduction one in-place all-reduce
    of the bucket instead of an interleaving copy plus gloo's reduce-scatter. Idempotent.

    ZeRO-3 partitions every parameter on its own (rank r owns chunk r of each), so its
    `reduce_scatter_coalesced` copies a bucket's gradients into a rank-interleaved buffer
    before one reduce-scatter. On gloo that collective is several times slower than an
    all-reduce of the same input, and the interleaving copy costs time on top of it.
    An all-reduce leaves every chunk in place, so each gradient's
    partition is a view of the bucket. Same values: each gradient is divided by the world
    size first and then summed, as DeepSpeed does.
    """
    import torch.distributed as dist
    from deepspeed.runtime.zero import stage3

    if dist.get_backend() == "gloo":
        stage3.reduce_scatter_coalesced = _reduce_scatter_coalesced_by_all_reduce


def _reduce_scatter_coalesced_by_all_reduce(
    tensors: list[torch.Tensor], group: torch.distributed.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """What DeepSpeed's `reduce_scatter_coalesced` returns: for each tensor, this rank's
    chunk (ceil(numel / world) elements; the last ranks' may be shorter or empty) of the
    mean over ranks. Tensors that tile one buffer (ZeRO-3's gradient bucket, in any order)
    are reduced in place, as DeepSpeed does with a single tensor; others are copied."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat, starts = _span(tensors)
    if flat is None:
        flat = torch.cat([t.reshape(-1) for t in tensors])
    flat.div_(world)
    dist.all_reduce(flat, group=group)
    parts = []
    for t, offset in zip(tensors, starts):
        n = t.numel()
        chunk = math.ceil(n / world)
        start = min(rank * chunk, n)
        parts.append(flat.narrow(0, offset + start, min(chunk, n - start)))
    return parts


def _span(tensors: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[int]]:
    """(one flat view over `tensors`, each tensor's start in it) if they tile one range of
    one storage without gaps or overlaps, in whatever order; else (None, their starts in
    their concatenation)."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    tiled = all(
        t.untyped_storage().data_ptr() == storage and t.is_contiguous() and t.dtype == first.dtype
        for t in tensors
    )
    if tiled:
        ranges = sorted((t.storage_offset(), t.numel()) for t in tensors)
        tiled = all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    if not tiled:
        ends = list(itertools.accumulate(t.numel() for t in tensors))
        return None, [0, *ends[:-1]]
    base, total = ranges[0][0], ranges[-1][0] + ranges[-1][1] - ranges[0][0]
    flat = first.new_empty(0).set_(first.untyped_storage(), base, (total,))
    return flat, [t.storage_offset() - base for t in tensors]
