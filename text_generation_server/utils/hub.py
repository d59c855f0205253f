"""Model files on disk and on the hub: locating a model locally, downloading its weights.

`resolve_model_dir` is the only way the shard finds a model; it never touches the network.
`download_weights` (the `download-weights` command, cli.py) is the only code that talks to the
hub: it fetches a model's files into the local Hugging Face cache and has weights.py convert
them when needed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from text_generation_common.logs import first_line
from text_generation_server.utils import weights

logger = logging.getLogger(__name__)


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_dir(
    model_name: str, revision: str | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The directory holding `model_name`: the path itself when it is a directory, else the
    snapshot of that hub id (at `revision`, default main) in the local HF cache (`cache_dir`,
    default HF_HUB_CACHE)."""
    path = Path(model_name)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(
            model_name,
            revision=revision,
            cache_dir=None if cache_dir is None else str(cache_dir),
            local_files_only=True,
        )
    except (LocalEntryNotFoundError, ValueError) as exc:
        where = cache_dir if cache_dir is not None else _default_cache_dir()
        raise ModelNotFoundError(
            f"model {model_name!r} not found: it is not a local directory and not in the "
            f"Hugging Face cache at {where} (run `text-generation-server download-weights {model_name}`)"
        ) from exc
    assert isinstance(snapshot, str)
    return Path(snapshot)


def _default_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


# --- downloading ----------------------------------------------------------------------------------

DEFAULT_EXTENSIONS = (".safetensors",)
DEFAULT_REVISION = "main"
# Files that describe a model (config, tokenizer, code, card) rather than hold its weights: taken
# along when a single weight extension is asked for.
METADATA_SUFFIXES = (".json", ".py", ".model", ".md", ".txt", ".jinja", ".tiktoken")
METADATA_PREFIXES = ("tokenizer",)
# Top-level files of training runs that share the weights' extensions but are not model weights.
TRAINING_FILE_PREFIXES = ("training_args", "optimizer", "scheduler", "rng_state", "trainer_state")
BIN_PREFIX = "pytorch_model"
# Vocabulary files of slow tokenizers, from which a tokenizer.json can be built.
SLOW_TOKENIZER_FILES = (
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
)


class WeightsNotFoundError(FileNotFoundError):
    """The requested weights are neither in the local directory nor obtainable from the hub."""


class HubUnavailableError(WeightsNotFoundError):
    """The hub could not be asked: network failure, offline mode, or an unexpected HTTP error."""


def download_weights(
    model_name: str,
    *,
    revision: str | None = None,
    extensions: Sequence[str] | None = DEFAULT_EXTENSIONS,
    auto_convert: bool = True,
    token: str | None = None,
) -> Path:
    """Make the weights of `model_name` available locally; returns the model directory.

    A local directory is only checked (and its .bin weights converted when needed). A hub id is
    downloaded into the Hugging Face cache (HF_HUB_CACHE): the top-level files ending with one of
    `extensions` and, when a single weight extension is asked for, the model's config, tokenizer,
    code and card files. When .safetensors weights are asked for but the repository has none and
    `auto_convert` is on, its PyTorch .bin weights are downloaded and converted to safetensors
    inside the snapshot. With `auto_convert`, a model without tokenizer.json but with a slow
    tokenizer also gets a fast one (best effort).

    Raises WeightsNotFoundError (HubUnavailableError when the hub cannot be asked) with a
    one-line message.
    """
    exts = _normalize_extensions(extensions)
    local = Path(model_name)
    if local.is_dir():
        model_dir = _check_local_weights(local, exts, auto_convert)
    elif _offline():
        model_dir = _check_local_weights(_cached_snapshot(model_name, revision), exts, auto_convert)
    else:
        model_dir = _download_from_hub(model_name, revision or DEFAULT_REVISION, exts, auto_convert, token)
    if auto_convert:
        _ensure_fast_tokenizer(model_dir)
    return model_dir


def _normalize_extensions(extensions: Sequence[str] | str | None) -> tuple[str, ...]:
    if extensions is None:
        return DEFAULT_EXTENSIONS
    items = extensions.split(",") if isinstance(extensions, str) else list(extensions)
    exts = [e.strip() for e in items if e.strip()]
    if not exts:
        raise ValueError("no weight file extensions given")
    return tuple(dict.fromkeys(e if e.startswith(".") else f".{e}" for e in exts))


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _cached_snapshot(model_name: str, revision: str | None) -> Path:
    try:
        return resolve_model_dir(model_name, revision)
    except ModelNotFoundError as exc:
        raise HubUnavailableError(
            f"model {model_name!r} is neither a local directory nor in the Hugging Face cache at "
            f"{_default_cache_dir()}, and HF_HUB_OFFLINE is set: it cannot be downloaded"
        ) from exc


def _check_local_weights(model_dir: Path, exts: tuple[str, ...], auto_convert: bool) -> Path:
    names = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    if _needs_conversion(exts, names, auto_convert):
        logger.info("%s has PyTorch .bin weights only: converting them to safetensors", model_dir)
        _convert(model_dir)
        return model_dir
    found = _matching(names, exts)
    if not found:
        hint = _bin_hint(exts, names, auto_convert)
        raise WeightsNotFoundError(f"no {_describe(exts)} weights in local directory {model_dir}{hint}")
    logger.info("%s is a local directory with %s: nothing to download", model_dir, ", ".join(found))
    return model_dir


def _download_from_hub(
    repo_id: str, revision: str, exts: tuple[str, ...], auto_convert: bool, token: str | None
) -> Path:
    commit, files = _list_repo_files(repo_id, revision, token)
    top_level = [f for f in files if "/" not in f]
    wanted = _select_files(top_level, exts)
    convert = _needs_conversion(exts, top_level, auto_convert)
    if convert:
        logger.info("%s has no .safetensors weights: downloading its PyTorch weights to convert", repo_id)
        wanted = sorted(set(wanted) | set(_bin_files(top_level)))
    elif not _matching(top_level, exts):
        raise WeightsNotFoundError(
            f"model {repo_id!r} at revision {revision!r} has no {_describe(exts)} weights"
            f"{_bin_hint(exts, top_level, auto_convert)}"
        )
    snapshot = _download_files(repo_id, revision, commit, wanted, token)
    if convert:
        if any(snapshot.glob("*.safetensors")):
            logger.info("%s already holds converted safetensors weights", snapshot)
        else:
            _convert(snapshot)
    return snapshot


def _matching(names: Iterable[str], exts: tuple[str, ...]) -> list[str]:
    """Top-level names with one of `exts`, training-run files excluded."""
    return [
        n for n in names if "/" not in n and n.endswith(exts) and not n.startswith(TRAINING_FILE_PREFIXES)
    ]


def _select_files(names: Iterable[str], exts: tuple[str, ...]) -> list[str]:
    names = list(names)
    selected = set(_matching(names, exts))
    if len(exts) == 1 and exts[0] not in METADATA_SUFFIXES:
        selected.update(n for n in names if _is_metadata(n))
    return sorted(selected)


def _is_metadata(name: str) -> bool:
    return "/" not in name and (name.endswith(METADATA_SUFFIXES) or name.startswith(METADATA_PREFIXES))


def _bin_files(names: Iterable[str]) -> list[str]:
    """The PyTorch weights (single file or shards + index) among top-level `names`."""
    return sorted(
        n
        for n in names
        if "/" not in n and n.startswith(BIN_PREFIX) and (n.endswith(".bin") or n == weights.PT_INDEX)
    )


def _has_bin_weights(names: Iterable[str]) -> bool:
    return any(n.endswith(".bin") for n in _bin_files(names))


def _needs_conversion(exts: tuple[str, ...], names: list[str], auto_convert: bool) -> bool:
    """Safetensors weights are asked for, missing, and can be made from .bin weights."""
    return (
        auto_convert
        and ".safetensors" in exts
        and not _matching(names, (".safetensors",))
        and _has_bin_weights(names)
    )


def _bin_hint(exts: tuple[str, ...], names: list[str], auto_convert: bool) -> str:
    if ".safetensors" in exts and not auto_convert and _has_bin_weights(names):
        return " (it has PyTorch .bin weights: allow auto-convert to convert them, or ask for .bin)"
    return ""


def _describe(exts: tuple[str, ...]) -> str:
    return " or ".join(exts)


def _convert(model_dir: Path) -> None:
    written = weights.convert_to_safetensors(model_dir)
    logger.info("converted to %s", ", ".join(p.name for p in written))


def _list_repo_files(repo_id: str, revision: str, token: str | None) -> tuple[str, list[str]]:
    """The commit that `revision` points to and the paths of the files it holds."""
    from huggingface_hub import HfApi

    logger.info("listing the files of %s at revision %s on %s", repo_id, revision, _endpoint())
    with _hub_errors(repo_id, revision, "listing the files"):
        info = HfApi().model_info(repo_id, revision=revision, token=token)
    if not info.sha or info.siblings is None:
        raise HubUnavailableError(
            f"the hub at {_endpoint()} returned no commit or file list for model {repo_id!r} "
            f"at revision {revision!r}"
        )
    return info.sha, [s.rfilename for s in info.siblings]


def _download_files(repo_id: str, revision: str, commit: str, names: list[str], token: str | None) -> Path:
    """Download `names` of `commit` into the HF cache; returns the snapshot directory."""
    from huggingface_hub import hf_hub_download

    logger.info(
        "downloading %d files of %s (revision %s, commit %s) into %s",
        len(names),
        repo_id,
        revision,
        commit,
        _default_cache_dir(),
    )
    snapshot: Path | None = None
    for name in names:
        with _hub_errors(repo_id, revision, f"downloading {name}"):
            path = hf_hub_download(repo_id, name, revision=commit, token=token)
        snapshot = Path(path).parent
    assert snapshot is not None, "nothing to download"
    _record_revision(snapshot, revision, commit)
    return snapshot


def _record_revision(snapshot: Path, revision: str, commit: str) -> None:
    """Point the cache's ref for `revision` at `commit`, as huggingface_hub does for named revisions,
    so that `resolve_model_dir(model, revision)` finds this snapshot offline."""
    if revision == commit or snapshot.parent.name != "snapshots":
        return
    ref = snapshot.parent.parent / "refs" / revision
    if ref.is_file() and ref.read_text() == commit:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str, action: str) -> Iterator[None]:
    """Turn huggingface_hub and network exceptions into one-line WeightsNotFoundErrors."""
    import httpx2  # huggingface_hub's HTTP client; its errors are the network failures
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = _endpoint()
    try:
        yield
    except GatedRepoError as exc:
        raise WeightsNotFoundError(
            f"model {repo_id!r} on {endpoint} is gated: accept its conditions and pass a token "
            "(--token / HF_TOKEN)"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise WeightsNotFoundError(
            f"model {repo_id!r} not found on {endpoint} "
            "(for a private model pass a token: --token / HF_TOKEN)"
        ) from exc
    except RevisionNotFoundError as exc:
        raise WeightsNotFoundError(
            f"revision {revision!r} of model {repo_id!r} not found on {endpoint}"
        ) from exc
    except RemoteEntryNotFoundError as exc:
        raise WeightsNotFoundError(
            f"{action} of model {repo_id!r} (revision {revision!r}) failed: not found on {endpoint}"
        ) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise HubUnavailableError(
            f"{action} of model {repo_id!r} failed: {endpoint} answered HTTP {status}"
        ) from exc
    except OfflineModeIsEnabled as exc:
        raise HubUnavailableError(
            f"model {repo_id!r} is not a local directory and cannot be downloaded: HF_HUB_OFFLINE is set"
        ) from exc
    except (httpx2.HTTPError, OSError) as exc:
        raise HubUnavailableError(
            f"{action} of model {repo_id!r} from {endpoint} failed: {first_line(exc)}"
        ) from exc


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def _ensure_fast_tokenizer(model_dir: Path) -> None:
    """Write tokenizer.json when the model has only a slow tokenizer; failures are only logged."""
    if (model_dir / weights.TOKENIZER_FILE).is_file():
        return
    if not any((model_dir / name).is_file() for name in SLOW_TOKENIZER_FILES):
        logger.debug("%s has no tokenizer files: no fast tokenizer to write", model_dir)
        return
    try:
        weights.convert_to_fast_tokenizer(model_dir)
    except Exception as exc:  # best effort: the model stays usable without tokenizer.json
        logger.warning("could not write a fast tokenizer for %s: %s", model_dir, first_line(exc))
