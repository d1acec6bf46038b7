"""The exceptions the command line maps to exit statuses (docs/architecture.md section 7).

Torch-free and dependency-free, so `cli.main` can catch them, and `distributed/` and the
other modules can raise them, without importing config, torch or the trainers.
`rlhf_dist.config`, `distributed.guard` and `trainers.common` re-export the ones they
used to define, under the same names.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake of the user's (config, data, their code); the CLI prints it as one line."""


class ConfigError(UserError, ValueError):
    """A user mistake in the configuration; its message is one line naming the key."""


class RewardFunctionError(UserError, RuntimeError):
    """The user's reward function raised or returned something unusable."""


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row (or a corrupted DeepSpeed step): the run stops."""


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint was written and the run stopped cleanly (exit 0)."""


class ServerError(RuntimeError):
    """A rollout server (generation.backend=server) failed, did not answer in time, or
    holds weights other than the trainer's (the post-sync check): the run stops (exit 4)."""
