"""A Hugging Face model id (`ORG/NAME`) as a checkpoint directory, through `huggingface_hub`.

    resolve(source, download=False, revision=None) -> Path

`source` naming an existing path is that path, unchanged (a local directory or file always wins,
so `runs/llama` is never looked up on the Hub). Otherwise an `ORG/NAME` id is looked up in the
Hugging Face cache with `huggingface_hub.snapshot_download` (where the hub's own tools put it:
`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub), and the snapshot directory of
`revision` (default `main`) is returned: `models--ORG--NAME/snapshots/<commit>/`, whose files
link into `blobs/`.

Nothing is downloaded unless the caller asks (`download=True`, the CLI's `--download`): then the
hub fetches the files lmjax reads (config.json, generation_config.json, *.safetensors and their
index, the tokenizer's files), unless `HF_HUB_OFFLINE=1` forbids the network, which the hub
honours by answering from the cache alone. Every failure is one `CheckpointError` line saying
what to do.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants, errors

from lmjax.errors import CheckpointError

# What import-hf reads of a repository (weights, configs, tokenizer files, a chat template).
PATTERNS = ["*.json", "*.safetensors", "merges.txt", "vocab.bpe", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def is_repo_id(source: str) -> bool:
    """`ORG/NAME` as the Hub spells ids: one slash, no leading `.` or `/`, no `..`."""
    return bool(_REPO_ID.fullmatch(source)) and ".." not in source


def resolve(source: str | os.PathLike, download: bool = False, revision: str | None = None) -> Path:
    """The checkpoint directory `source` names (see the module docstring)."""
    path = Path(source)
    if path.exists() or not is_repo_id(str(source)):
        return path  # the loaders say what is wrong with a path that does not exist
    repo = str(source)
    try:
        found = huggingface_hub.snapshot_download(
            repo, revision=revision, allow_patterns=PATTERNS, local_files_only=not download
        )
    except (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError):
        raise _not_cached(repo, revision, download) from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as err:
        expected = f"a model on the Hugging Face Hub ({type(err).__name__})"
        fix = "check the id and --revision (a private model needs `hf auth login`)"
        raise CheckpointError.describe("model id", repo, expected, fix) from None
    except errors.GatedRepoError:
        expected = "a model this account may download (it is gated)"
        fix = "accept its terms on huggingface.co and log in with `hf auth login`"
        raise CheckpointError.describe("model id", repo, expected, fix) from None
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError.describe(
            "model id", repo, f"a model the Hub serves ({first[:100]})", "check the id and network"
        ) from None
    return Path(found)


def _not_cached(repo: str, revision: str | None, download: bool) -> CheckpointError:
    """The error for an id the cache does not hold (and that could not, or may not, be fetched).
    The cached ids nearest `repo` come first in its fix (a typo: `myorg/tiny-chta`); under
    HF_HUB_OFFLINE=1 it never says --download, which could not fetch anything."""
    where = f"{constants.HF_HUB_CACHE}"
    at = f"@{revision}" if revision else ""
    near = [name for name in difflib.get_close_matches(repo, cached_ids(), n=3) if name != repo]
    did_you_mean = f"did you mean {' or '.join(near)} (cached)? Else " if near else ""
    if constants.HF_HUB_OFFLINE:
        fix = (
            "unset HF_HUB_OFFLINE to download it, or copy the model into the cache"
            if download
            else "copy the model into the cache, or point at a local directory"
        )
        return CheckpointError.describe(
            "Hugging Face checkpoint",
            repo + at,
            f"a model in the Hugging Face cache ({where}): HF_HUB_OFFLINE=1 forbids downloads",
            did_you_mean + fix,
        )
    if not download:
        return CheckpointError.describe(
            "Hugging Face checkpoint",
            repo + at,
            f"a local directory or a model in the Hugging Face cache ({where}); lmjax "
            "downloads nothing unless asked",
            f"{did_you_mean}pass --download to fetch it from the Hub, or `hf download {repo}` "
            "first, or point at a local directory",
        )
    return CheckpointError.describe(
        "Hugging Face checkpoint",
        repo + at,
        f"a model the Hub serves or the cache holds ({where}); the download failed",
        "check the network (and HF_ENDPOINT), then run the command again",
    )


def cached_ids() -> list[str]:
    """The model ids the Hugging Face cache holds, from its `models--ORG--NAME` directories
    (a listing: no file is read), sorted; none when there is no cache."""
    try:
        names = [entry.name for entry in Path(constants.HF_HUB_CACHE).iterdir()]
    except OSError:
        return []
    prefix = "models--"
    return sorted(n[len(prefix) :].replace("--", "/") for n in names if n.startswith(prefix))


__all__ = ["PATTERNS", "cached_ids", "is_repo_id", "resolve"]
