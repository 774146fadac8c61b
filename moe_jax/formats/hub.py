"""Models by Hugging Face Hub id: `Qwen/Qwen3-30B-A3B` (a safetensors checkpoint) or `org/repo/path/model.gguf` (one
GGUF file of a repository), fetched into the Hub cache with `huggingface_hub` and loaded from there.

Only what moe_jax reads is fetched: the config, the tokenizer and chat template files, and the weights (one GGUF
file, never the repository's other quantizations). The cache, the token and offline use are huggingface_hub's own
(`HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE=1`: the cache only). A path that exists is always a path.
"""

from __future__ import annotations

import re
from pathlib import Path

from moe_jax.errors import CheckpointError
from moe_jax.formats.checkpoint import SIDE_FILES

CHECKPOINT_FILES = [*SIDE_FILES, "*.safetensors", "model.safetensors.index.json"]  # what a directory needs
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_id(spec) -> tuple[str, str | None] | None:
    """(repository id, GGUF file in it or None) when `spec` names a Hub model rather than a local path."""
    text = str(spec)
    if Path(text).exists() or text.startswith((".", "/", "~")):
        return None
    parts = text.split("/")
    if len(parts) >= 3 and text.endswith(".gguf") and _REPO_ID.fullmatch("/".join(parts[:2])):
        return "/".join(parts[:2]), "/".join(parts[2:])
    return (text, None) if _REPO_ID.fullmatch(text) else None


def resolve_model(spec) -> Path:
    """The local path of `spec`: itself when it is a path, else the Hub model it names, fetched into the cache."""
    named = hub_id(spec)
    if named is None:
        return Path(spec)
    import huggingface_hub
    from huggingface_hub import errors

    repo, gguf_file = named
    try:
        if gguf_file is not None:
            return Path(huggingface_hub.hf_hub_download(repo, gguf_file))
        return Path(huggingface_hub.snapshot_download(repo, allow_patterns=CHECKPOINT_FILES))
    except errors.LocalEntryNotFoundError:
        raise CheckpointError(
            f"{spec}: no such directory, and not in the Hugging Face cache (offline: HF_HUB_OFFLINE, or no network)"
        ) from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        raise CheckpointError(
            f"{spec}: no such directory, and the Hub refused the model ({type(e).__name__})"
        ) from None
    except (errors.EntryNotFoundError, errors.RevisionNotFoundError) as e:
        raise CheckpointError(f"{spec}: not found on the Hub ({e})") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{spec}: could not fetch it from the Hub ({e})") from None
