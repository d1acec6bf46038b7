"""CPU-specific speed paths: decode linears from MKL-packed weights
(perf.packed_linears), grouped-query attention without copying KV heads
(perf.grouped_kv_attention), and glibc's malloc keeping freed host memory
(perf.retain_host_memory). Each is exact or within fp32 rounding of the plain path
(tests/unit/test_unit_perf_switches.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from rlhf_dist.config import PerfConfig
from rlhf_dist.distributed.zero3 import stays_whole


@contextlib.contextmanager
def grouped_query_attention_on_cpu() -> Iterator[None]:
    """Inside: transformers' sdpa attention hands grouped-query K/V of CPU tensors to
    torch's scaled_dot_product_attention as they are (enable_gqa) instead of first copying
    every KV head num_key_value_groups times (its repeat_kv). transformers turns enable_gqa
    on only without an attention mask, because CUDA's fused kernels then fall back to the
    math one; CPU's flash kernel takes the mask and the grouped heads alike and returns the
    same values bitwise. In a decode step the copy is of the whole KV cache, every layer,
    and costs more than the attention itself. Process-wide while inside; a no-op where transformers lacks the hook."""
    from transformers.integrations import sdpa_attention

    original = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if original is None:
        yield
        return

    def use_gqa(
        attention_mask: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor
    ) -> bool:
        return key.device.type == "cpu" or original(attention_mask, key, value)

    sdpa_attention.use_gqa_in_sdpa = use_gqa
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = original


# The packed copies live for one `generate` call; above this many bytes of linear weights
# (a ~0.5B-parameter fp32 model) that second copy of the weights costs more host memory
# than a CPU rollout should take, and the products are nearer the GEMM rate anyway.
PACK_LIMIT_BYTES = 2 * 2**30


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int) -> Iterator[None]:
    """Inside: every plain fp32 `nn.Linear` of `model` whose weight is a whole CPU tensor
    computes its products from a copy of the weight that MKL packed once for `rows`-row
    inputs (cblas_sgemm_pack, torch.ops.mkl), instead of MKL packing the weight again in
    every call. A decode step feeds each linear the B rows of the micro-batch, so that
    repacking streamed every weight through memory twice per token (docs/benchmarks.md,
    "Decode linears from MKL-packed weights"). MKL computes a packed product with the
    same kernels: the same bits as F.linear, for `rows` rows and for any other row count
    (which it runs unpacked). No autograd: `generate` only (no grad). Left as they are:
    other dtypes, fp32 weights under CPU autocast (mixed precision: the products run in
    bf16), ZeRO-3 partitioned weights (whole only while their module runs), a build
    without MKL, and models whose linear weights exceed PACK_LIMIT_BYTES; an input that is
    not fp32, or autocast entered inside, goes to F.linear. Modules are restored on exit;
    the packed copies are freed."""
    linears = _packable_linears(model)
    for m in linears:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(m.weight.detach(), rows)
        m.forward = functools.partial(_packed_forward, m, packed, rows)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def _packable_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """`packed_linears`' modules: plain fp32 CPU linears with whole weights, or none."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return []
    if torch.is_autocast_enabled("cpu"):
        return []
    linears = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        and stays_whole(m.weight)
        and m.weight.dim() == 2
        and m.weight.numel() > 0
    ]
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return linears if size <= PACK_LIMIT_BYTES else []


def _packed_forward(
    linear: torch.nn.Linear, packed: torch.Tensor, rows: int, x: torch.Tensor
) -> torch.Tensor:
    """linear(x) for x (..., in) from the packed weight: (..., out), contiguous."""
    if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        # MKL's packed product is fp32 x fp32 only; autocast's is the module's own
        return torch.nn.functional.linear(x, linear.weight, linear.bias)
    flat = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkl._mkl_linear(flat, packed, linear.weight, linear.bias, rows)
    return y.reshape(*x.shape[:-1], linear.weight.shape[0])


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def retain_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (run.retain_host_memory); process-wide.

    By default glibc serves every block above 32 MiB (less before its threshold adapts)
    with its own mmap and unmaps it on free, and trims the heap's free top: a (C, V) logits
    chunk, an activation or a gradient of a real model then arrives as fresh pages, and
    the kernel zero-fills each 4 KiB page on its first touch. On CPU that page-fault work
    is a large share of an update (docs/benchmarks.md, "Retained host memory"). With mmap off and the trim threshold at its
    maximum (mallopt takes a C int: 2 GiB), blocks come from the heap and freed ones are
    reused: the resident size stays at its peak instead of falling back, and fragmentation
    can raise that peak a little.
    PyTorch's own advice for CPU is a caching allocator (jemalloc/tcmalloc preloaded);
    this needs no preload.
    Returns whether it applied (False off glibc, e.g. macOS or musl)."""
    if not _glibc_version():
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def _glibc_version() -> str:
    """'glibc 2.36' under glibc, '' elsewhere (musl, macOS, Windows: no confstr)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return ""


def decode_context(model: torch.nn.Module, rows: int, perf: PerfConfig) -> contextlib.ExitStack:
    """The CPU speed paths of a decode loop over `model` with `rows`-row batches: packed
    linear weights (perf.packed_linears) and uncopied grouped KV heads
    (perf.grouped_kv_attention); each is a no-op where it does not apply (not CPU, not
    fp32, ...)."""
    stack = contextlib.ExitStack()
    if perf.packed_linears:
        stack.enter_context(packed_linears(model, rows))
    stack.enter_context(scoring_context(perf))
    return stack


def scoring_context(perf: PerfConfig) -> contextlib.AbstractContextManager[None]:
    """The CPU speed path of forwards without gradients (rollout scoring): uncopied
    grouped KV heads (perf.grouped_kv_attention), else nothing."""
    if perf.grouped_kv_attention:
        return grouped_query_attention_on_cpu()
    return contextlib.nullcontext()


def apply_host_memory_setting(perf: PerfConfig, device: torch.device) -> bool:
    """perf.retain_host_memory for a process computing on `device`: on a CPU device,
    `retain_freed_host_memory` (process-wide, like the thread count); otherwise nothing.
    Returns whether it applied."""
    if not (perf.retain_host_memory and device.type == "cpu"):
        return False
    return retain_freed_host_memory()
