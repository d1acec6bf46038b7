"""After a stage's export and summary.json: a model card (README.md) in every exported
directory, then, with run.push_to_hub, the upload to the Hugging Face Hub (docs/distributed.md,
"Model cards and the Hugging Face Hub"). Called last, so the card carries the final numbers."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_dist.config import Config, to_dict
from rlhf_dist.config.tasks import is_task_spec
from rlhf_dist.data import inputs
from rlhf_dist.errors import UserError
from rlhf_dist.files import atomic_write_text
from rlhf_dist.names import ESTIMATORS
from rlhf_dist.observability.hub import push_folders
from rlhf_dist.observability.model_card import CardFacts, card_text

if TYPE_CHECKING:
    from rlhf_dist.distributed import Runtime


def exports(cfg: Config, stage: str, out: Path) -> dict[str, tuple[Path, str]]:
    """{card kind: (directory, path in the hub repository)} of what `stage` exported with this
    config (decided from the config, not from what lies in `out`: a directory left by an
    earlier run is not this run's model)."""
    lora = cfg.lora.enabled and stage != "rm"  # rm trains all weights (validation)
    merged = not lora or cfg.lora.export in ("merged", "both")
    found: dict[str, tuple[Path, str]] = {}
    if merged:
        found["reward" if stage == "rm" else "policy"] = (out / "final", "")
    if lora and cfg.lora.export in ("adapter", "both"):
        found["adapter"] = (out / "final_adapter", "adapter" if merged else "")
    if stage == "ppo" and ESTIMATORS[cfg.ppo.estimator].needs_critic:
        found["critic"] = (out / "critic", "critic")
    return found


def base_model(cfg: Config, stage: str, kind: str) -> str:
    """The model the export started from."""
    m = cfg.model
    if kind == "reward" or (kind == "critic" and cfg.ppo.critic_init == "reward"):
        return m.reward or m.policy
    return m.policy


def on_hub(name: str) -> bool:
    """`name` can only mean a hub model or dataset: not a Python object, not a reasoning-gym
    task, not a local path."""
    if not name or inputs.is_python(name) or is_task_spec(name):
        return False
    return not Path(name).expanduser().exists()


def card_facts(
    cfg: Config, stage: str, kind: str, where: tuple[Path, str], summary: dict
) -> CardFacts:
    """What the card of `kind` exported to `where` (directory, path in the hub repository)
    says; it names where to load the model from: the hub repository when the run pushes,
    else the local directory."""
    (directory, subfolder), base = where, base_model(cfg, stage, kind)
    pushed = cfg.run.push_to_hub
    return CardFacts(
        stage=stage,
        kind=kind,
        config=to_dict(cfg),
        base_model=base,
        base_on_hub=on_hub(base),
        hub_datasets=tuple(d for d in (cfg.data.train, cfg.data.eval) if on_hub(d)),
        metrics=summary,
        date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        load_from=cfg.run.hub_model_id if pushed else str(directory),
        subfolder=subfolder if pushed else "",
    )


def publish(cfg: Config, runtime: Runtime, out: Path, stage: str, summary: dict) -> None:
    """README.md in every export of `stage`, then the upload with run.push_to_hub, on the
    main process. Every rank must call this: a failed upload is one UserError line (exit 2)
    raised on all ranks together, after everything is on disk (a rank that went on alone to
    a next stage would wait for the others in its first collective)."""
    error = ""
    if runtime.is_main:
        try:
            _publish_main(cfg, runtime, out, stage, summary)
        except UserError as e:
            error = str(e)
    if cfg.run.push_to_hub:
        error = next((e for e in runtime.gather_objects([error]) if e), "")
    if error:
        raise UserError(error)


def _publish_main(cfg: Config, runtime: Runtime, out: Path, stage: str, summary: dict) -> None:
    """`publish` on the main process: the cards, then the upload (a UserError if it fails)."""
    found = exports(cfg, stage, out)
    for kind, where in found.items():
        text = card_text(card_facts(cfg, stage, kind, where, summary))
        atomic_write_text(where[0] / "README.md", text)
    if cfg.run.push_to_hub:
        folders = list(found.values())
        url = push_folders(cfg.run, folders, f"rlhf-dist {stage}")
        names = ", ".join(f"{d.name}/ -> {p or '.'}" for d, p in folders)
        runtime.print(f"{stage}: pushed {names} to {url}")
