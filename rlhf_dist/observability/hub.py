"""run.push_to_hub: upload a run's exported models to the Hugging Face Hub (docs/distributed.md,
"Model cards and the Hugging Face Hub").

One repository, run.hub_model_id: final/ at its root (so `from_pretrained(hub_model_id)`
loads the model), final_adapter/ under adapter/ (at the root when there is no final/) and
critic/ under critic/ (`from_pretrained(hub_model_id, subfolder="critic")`). The token is
read from the environment variable run.hub_token_env at upload time and handed to
`HfApi` only; it is never printed, logged or written. The endpoint is huggingface_hub's
(HF_ENDPOINT for a private hub or a local stand-in).
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import HfApi

from rlhf_dist.config import RunConfig
from rlhf_dist.errors import UserError


def hub_token(run: RunConfig) -> str | None:
    """The token in $run.hub_token_env; None: huggingface_hub's own (HF_TOKEN, saved login)."""
    return os.environ.get(run.hub_token_env) or None


def push_folders(run: RunConfig, folders: list[tuple[Path, str]], message: str) -> str:
    """Create run.hub_model_id if needed and upload each (local folder, path in the repo);
    returns the repository's URL. Any failure is one UserError line naming the folder (the
    files stay on disk), with the token masked should the server echo it."""
    token = hub_token(run)
    api = HfApi(token=token)
    repo, done = run.hub_model_id, 0
    try:
        url = str(api.create_repo(repo, private=run.hub_private, exist_ok=True))
        for folder, path_in_repo in folders:
            api.upload_folder(
                repo_id=repo,
                folder_path=folder,
                path_in_repo=path_in_repo or None,
                commit_message=f"{message}: {folder.name}",
            )
            done += 1
    except Exception as e:  # network, HTTP and validation errors of many types
        what = (str(e).strip().splitlines() or [""])[0]
        if token:
            what = what.replace(token, "***")
        # `done` < len(folders): the folder that failed (repository creation: the first).
        again = "; ".join(
            "`" + " ".join(filter(None, ("hf upload", repo, str(f), p))) + "`"
            for f, p in folders[done:]
        )
        raise UserError(
            f"run.push_to_hub: uploading {folders[done][0]} to {repo} failed ({type(e).__name__}: "
            f"{what}); the model stays on disk, push it again with {again}"
        ) from None
    return url
