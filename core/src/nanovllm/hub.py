"""Hugging Face hub IDs (``Qwen/Qwen3-0.6B``) to local directories, through the hub's own cache.

Offline (``HF_HUB_OFFLINE=1``) only the local cache is read. Otherwise the snapshot is checked against the
hub and whatever files it lacks are downloaded; when the hub cannot be reached, ``huggingface_hub`` falls back
to the cached snapshot by itself. Only the files nanovllm reads are fetched: configs, safetensors weights,
tokenizer and chat template files (never ``*.bin`` / ``*.pt`` weights, never Python code).
"""

from __future__ import annotations

import os
from pathlib import Path

# what a model directory needs: config.json, generation_config.json, tokenizer files, weights, chat templates
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class HubError(ValueError):
    """A hub ID that cannot be found in the cache or downloaded."""


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as set now (``huggingface_hub`` reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE)


def is_hub_id(name: str) -> bool:
    """``name`` has the shape of a repository ID (``repo`` or ``owner/repo``), not of a filesystem path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "~", "/")) or name.count("/") > 1 or os.sep != "/" and os.sep in name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_hub_id(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` (default: ``main``) in the hub cache
    (``cache_dir``, default ``HF_HUB_CACHE``), downloaded first unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"revision {revision!r} of " if revision else ""
    cache = cache_dir or "the Hugging Face cache (HF_HUB_CACHE)"
    offline = hub_offline()
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline,
            allow_patterns=DOWNLOAD_PATTERNS,
        )
    except LocalEntryNotFoundError as exc:
        fix = (
            "unset HF_HUB_OFFLINE to download it, or fetch it on a machine with access: "
            f"hf download {repo_id}" if offline else "check the connection to the hub, or download it elsewhere"
        )
        raise HubError(f"{where}{repo_id!r} is not in {cache}, and it cannot be downloaded here ({fix})") from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise HubError(
            f"{repo_id!r} is neither a local directory nor a hub model that can be read ({type(exc).__name__}); "
            "check the name, or log in (hf auth login) for a gated or private model"
        ) from exc
    except (RevisionNotFoundError, EntryNotFoundError) as exc:
        raise HubError(f"{where}{repo_id!r} does not exist on the hub: {exc}") from exc
    return Path(folder)
