"""What a PPO run carries from one iteration to the next, and what a checkpoint keeps of
it (docs/architecture.md section 7). The run's objects (setup.PPORun) are frozen; the
loop's own progress is a frozen `Progress`, a new one after every iteration, and the
iteration's state a frozen `controllers.Controllers`, returned new by every iteration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlhf_dist.checkpoint import Checkpoint, set_rng_state
from rlhf_dist.config import Config
from rlhf_dist.distributed import Runtime
from rlhf_dist.errors import RewardFunctionError, ServerError
from rlhf_dist.observability.alerts import AlertMonitor
from rlhf_dist.observability.tracking import MetricsLogger
from rlhf_dist.trainers.common import write_checkpoint
from rlhf_dist.trainers.ppo.controllers import Controllers
from rlhf_dist.trainers.ppo.setup import PPORun


@dataclass(frozen=True)
class Progress:
    """The loop's progress: the first iteration's score (of the whole run, a resumed one
    included) and the last iteration's statistics (for the summary)."""

    first_score: float | None = None
    stats: dict[str, float] | None = None

    @classmethod
    def resumed(cls, ckpt: Checkpoint | None) -> Progress:
        """At the start of the loop: the first score the checkpoint kept, if resuming."""
        return cls(ckpt.trainer["first_score"] if ckpt else None)

    def after(self, stats: dict[str, float]) -> Progress:
        """The progress after an iteration that reported `stats`."""
        first = stats["objective/score"] if self.first_score is None else self.first_score
        return Progress(first, stats)


def trainer_state(
    run: PPORun, ctl: Controllers, first_score: float | None, alerts: AlertMonitor
) -> dict:
    """Everything besides weights and optimizer that a resumed run must continue from:
    the controllers after the last completed iteration, the schedule, the alerts, ..."""
    return ctl.state_dict() | {
        "scheduler": run.scheduler.state_dict(),
        "first_score": first_score,
        "alerts": alerts.state_dict(),
        "ptx_position": run.ptx.position if run.ptx is not None else 0,  # batches drawn
    }


def stop_on_failure(
    cfg: Config,
    runtime: Runtime,
    run_files: tuple[Path, MetricsLogger],
    run: PPORun,
    done: tuple[int, dict],
    state: dict,
    error: RewardFunctionError | ServerError,
) -> RewardFunctionError | ServerError:
    """The error to end the run with after the reward failed (RewardFunctionError, retries
    spent) or a rollout server did (ServerError) in the iteration after `done`; raised on
    every rank together (retry.py; generation/server.py agrees over the ranks).

    run_files: (output dir, MetricsLogger); done: (last completed iteration, the RNG
    states at its end); state: trainer_state. The failed iteration's rollout changed no
    weights, optimizer or trainer state, so with its RNG put back the checkpoint written
    at `done` is the one the unbroken run would have written there: `--resume auto`
    continues bitwise (docs/architecture.md section 7). With nothing completed (done 0)
    there is nothing to keep, and the run directory is removed, as for any user mistake.
    """
    (out, logger), (step, rng) = run_files, done
    if step == 0:
        logger.discard()
        return error
    set_rng_state(rng)
    write_checkpoint(cfg, runtime, out, step, run.model, run.optimizer, state)
    logger.close()
    fix = "fix the reward" if isinstance(error, RewardFunctionError) else "restart the server"
    return type(error)(
        f"{error}; iteration {step} and all before it are checkpointed in "
        f"{out / 'checkpoints'}: {fix}, then continue with --resume auto"
    )
