"""rlhf_dist: RLHF (SFT -> Bradley-Terry reward model -> PPO) on Accelerate + DeepSpeed.

The stage functions of the Python API (rlhf_dist/api.py) are importable from here:
`rlhf_dist.sft`, `reward_model`, `ppo`, `grpo`, `online_dpo`, `dpo`, `kto`, `eval`,
`iterate`. They load on first use,
so `import rlhf_dist.algo` stays torch-only and `rlhf-dist --help` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable

__version__ = "0.1.0"

# Named so no submodule shadows them: `import rlhf_dist.evaluate` rebinds that attribute
# to the module, so the eval stage is `rlhf_dist.eval` (and iterate's module is iterative).
API = ("sft", "reward_model", "ppo", "grpo", "online_dpo", "dpo", "kto", "eval", "iterate")


def __getattr__(name: str) -> Callable[..., dict]:
    """A stage function of rlhf_dist.api, imported on first use (PEP 562)."""
    if name in API:
        from rlhf_dist import api

        return getattr(api, name)
    raise AttributeError(f"module 'rlhf_dist' has no attribute {name!r}")
