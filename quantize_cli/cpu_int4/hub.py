"""Hugging Face Hub I/O: download what quantizing needs, push a finished output folder.

Everything goes through the real `huggingface_hub` client, so HF_TOKEN, HF_HOME, HF_HUB_CACHE,
HF_ENDPOINT and HF_HUB_OFFLINE behave as they do for any HF tool. Every client error becomes a
one-line QuantizeError that says what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, constants, get_token, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from .errors import QuantizeError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What quantizing and running the output need; never *.bin, *.gguf or other weight formats.
DOWNLOAD_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "*.jinja",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "README.md",
    "LICENSE*",
]


def looks_like_hub_id(model: str) -> bool:
    """`org/name` that is not an existing local path."""
    return bool(HUB_ID.match(model)) and not Path(model).exists()


def download(repo_id: str, revision: str | None = None) -> Path:
    """Download (or find in the cache) the files quantizing needs; returns the snapshot folder."""
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=DOWNLOAD_PATTERNS))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        # An HTTP error such as 403 makes the client fall back to the cache; report the HTTP error.
        cause = err.__cause__ or err.__context__
        if isinstance(cause, HfHubHTTPError):
            raise QuantizeError(describe_error(cause, repo_id, "download")) from err
        if constants.HF_HUB_OFFLINE:
            raise QuantizeError(
                f"HF_HUB_OFFLINE=1 and {where} is not in the cache ({constants.HF_HUB_CACHE}); "
                "download it once with network access"
            ) from err
        raise QuantizeError(
            f"cannot reach the Hub at {constants.ENDPOINT} and {where} is not cached"
        ) from err
    except Exception as err:
        raise QuantizeError(describe_error(err, repo_id, "download")) from err


def push(
    folder: Path,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Create the repo if needed and upload `folder` in one commit; returns the repo URL."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise QuantizeError(f"{folder} is not a quantized model folder (no config.json)")
    if not get_token():
        raise QuantizeError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        api.upload_folder(
            folder_path=folder,
            repo_id=repo_id,
            revision=revision,
            commit_message=commit_message or f"Upload {folder.name} (cpu-int4)",
        )
    except Exception as err:
        raise QuantizeError(describe_error(err, repo_id, "push")) from err
    return str(url)


def describe_error(err: Exception, repo_id: str, action: str) -> str:
    """One line for a Hub client error; re-raises what is not a Hub or network problem."""
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HFValidationError):
        return f"invalid repo id {repo_id!r}: use the form org/name"
    if isinstance(err, GatedRepoError):
        return f"{repo_id} is gated: accept its terms on the Hub and set HF_TOKEN"
    if isinstance(err, RevisionNotFoundError):
        return f"revision not found in {repo_id}"
    if status == 401:
        return f"the Hub rejected the token (401) while trying to {action} {repo_id}; set a valid HF_TOKEN"
    if status == 403:
        return f"the token may not {action} {repo_id} (403 forbidden); use a token with write access"
    if isinstance(err, RepositoryNotFoundError) or status == 404:
        return f"repository {repo_id} not found on the Hub (or private and the token cannot see it)"
    if isinstance(err, (httpx2.TransportError, ConnectionError)):
        return f"cannot reach the Hub at {constants.ENDPOINT}: {err}"
    if isinstance(err, HfHubHTTPError):
        return f"the Hub answered {status} while trying to {action} {repo_id}"
    raise err
