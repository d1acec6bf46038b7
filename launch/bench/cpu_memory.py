"""Peak tensor memory of a CPU process, across all its threads (benchmarks only).

torch has no CPU counterpart of `torch.cuda.max_memory_allocated`. The profiler's
allocation records (`profile_memory=True`) see only the threads the profiler runs in:
under gloo, a collective's buffers are often freed by gloo's worker threads, so those
frees are missing and the records' running sum grows without bound (measured: +50 MiB per
rollout of a 5 MiB model under ZeRO-3's per-layer fetches, while the live tensors did not
grow). This module wraps torch's CPU allocator in one that counts the bytes it hands out
and takes back, from any thread: `install()` once, before the tensors to be counted exist;
then `held()`, `peak()` and `reset_peak()` as torch.cuda's allocator counters.

The wrapper is a small C++ extension built on first use with torch.utils.cpp_extension
(g++ and ninja; ~1-2 minutes on 2 cores, then cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>

namespace {
std::atomic<int64_t> held{0};
std::atomic<int64_t> peak{0};

// The wrapped allocation, freed through its own deleter when the context is deleted.
struct Counted {
  c10::DataPtr inner;
  size_t nbytes;
};

void release(void* context) {
  auto* counted = static_cast<Counted*>(context);
  held -= static_cast<int64_t>(counted->nbytes);
  delete counted;
}

struct CountingAllocator final : c10::Allocator {
  explicit CountingAllocator(c10::Allocator* base) : base(base) {}
  c10::DataPtr allocate(size_t nbytes) override {
    c10::DataPtr inner = base->allocate(nbytes);
    void* data = inner.get();
    int64_t now = held += static_cast<int64_t>(nbytes);
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return {data, new Counted{std::move(inner), nbytes}, &release, c10::Device(c10::kCPU)};
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  c10::Allocator* base;
};
}  // namespace

void install() {
  static CountingAllocator counting(c10::GetCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/100);
}
int64_t held_bytes() { return held.load(); }
int64_t peak_bytes() { return peak.load(); }
void reset_peak() { peak.store(held.load()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("held_bytes", &held_bytes);
  m.def("peak_bytes", &peak_bytes);
  m.def("reset_peak", &reset_peak);
}
"""

_module = None


def install() -> None:
    """Count every CPU tensor allocation from now on (idempotent)."""
    global _module
    if _module is None:
        import os
        import sys

        from torch.utils.cpp_extension import load_inline

        # ninja comes with the venv (pip's ninja): its bin/ on PATH for the build
        bin_dir = os.path.dirname(sys.executable)
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

        _module = load_inline("rlhf_dist_cpu_memory", cpp_sources=[_SOURCE], extra_cflags=["-O2"])  # fmt: skip
        _module.install()


def held() -> int:
    """Bytes of the counted allocations alive now."""
    return _module.held_bytes()


def peak() -> int:
    """The most bytes held at once since install() or the last reset_peak()."""
    return _module.peak_bytes()


def reset_peak() -> None:
    """Start a new peak from what is held now."""
    _module.reset_peak()
