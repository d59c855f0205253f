"""Converting the files of a local model directory: .bin weights to safetensors, slow tokenizers
to a fast one (tokenizer.json).

Called by `download-weights` after a download (utils/hub.py) and directly by the
`convert-to-safetensors` / `convert-to-fast-tokenizer` commands (cli.py). Works on one local
directory (a plain model folder or a snapshot in the Hugging Face cache) and never touches the
network. New files are written beside their final name and then renamed over it, so a cache
snapshot's symlinks are replaced rather than written through into the shared blobs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import re
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from text_generation_common.logs import first_line

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PT_WEIGHTS = "pytorch_model.bin"
PT_INDEX = "pytorch_model.bin.index.json"
ST_WEIGHTS = "model.safetensors"
ST_INDEX = "model.safetensors.index.json"
ST_METADATA = {"format": "pt"}
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers 5 saves its generic fast tokenizer under this class name, which 4.x cannot load.
GENERIC_FAST_TOKENIZER_V5 = "TokenizersBackend"
GENERIC_FAST_TOKENIZER = "PreTrainedTokenizerFast"
# Loading options that transformers 5 records in tokenizer_config.json: they describe how this
# process loaded the tokenizer, not the tokenizer.
LOAD_TIME_TOKENIZER_KEYS = ("is_local", "local_files_only")

TiedTargets = Callable[[], list[re.Pattern[str]]]


# --- .bin -> safetensors -------------------------------------------------------------------------


def convert_to_safetensors(model_dir: Path) -> list[Path]:
    """Convert the PyTorch weights of `model_dir` to safetensors beside them; returns the files written.

    `pytorch_model.bin` becomes `model.safetensors`; a sharded set (`pytorch_model.bin.index.json`)
    becomes `model-0000i-of-0000N.safetensors` shards (same split) plus `model.safetensors.index.json`.
    Names that share one tensor (tied weights) are saved once. Every written tensor is read back and
    compared with its source. The .bin files are left in place.
    """
    model_dir = Path(model_dir)
    sources = bin_weight_files(model_dir)
    sharded = (model_dir / PT_INDEX).is_file()
    targets = _safetensors_names(len(sources)) if sharded else [ST_WEIGHTS]
    tied_targets = functools.cache(lambda: _tied_weight_targets(model_dir))

    written: list[Path] = []
    weight_map: dict[str, str] = {}
    total_size = 0
    for source, target in zip(sources, targets, strict=True):
        logger.info("converting %s to %s", source, target)
        sizes = _convert_file(source, model_dir / target, tied_targets)
        weight_map.update(dict.fromkeys(sizes, target))
        total_size += sum(sizes.values())
        written.append(model_dir / target)
    if sharded:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        written.append(_write_json_atomically(model_dir / ST_INDEX, index))
    logger.info("wrote %s (%d tensors)", ", ".join(str(p) for p in written), len(weight_map))
    return written


def bin_weight_files(model_dir: Path) -> list[Path]:
    """The PyTorch weight files of `model_dir`: the shards named by its index, else pytorch_model.bin."""
    index = model_dir / PT_INDEX
    if index.is_file():
        return _index_shards(index)
    single = model_dir / PT_WEIGHTS
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no PyTorch weights to convert in {model_dir}: expected {PT_WEIGHTS} or {PT_INDEX}"
    )


def _index_shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"cannot read the weight index {index}: {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"the weight index {index} has no weight_map")
    bad = sorted({str(n) for n in weight_map.values() if not isinstance(n, str) or Path(n).name != n})
    if bad:
        raise ValueError(f"the weight index {index} names shards outside its directory: {bad}")
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise FileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing)}")
    return [index.parent / n for n in names]


def _safetensors_names(count: int) -> list[str]:
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _convert_file(source: Path, target: Path, tied_targets: TiedTargets) -> dict[str, int]:
    """Convert one .bin file; returns the byte size of each tensor saved, by name."""
    import torch

    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise ValueError(f"cannot load {source} as plain tensors (weights_only): {first_line(exc)}") from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{source} does not hold a flat state dict of tensors")
    tensors = _unshare(_drop_duplicate_names(dict(state), tied_targets))
    _save_safetensors(tensors, target)
    _verify(target, tensors, source)
    return {name: t.numel() * t.element_size() for name, t in tensors.items()}


def _drop_duplicate_names(
    state: dict[str, torch.Tensor], tied_targets: TiedTargets
) -> dict[str, torch.Tensor]:
    """Keep one name per tensor when several names are the very same tensor (tied weights)."""
    groups: dict[tuple[Any, ...], list[str]] = defaultdict(list)
    for name, tensor in state.items():
        groups[_view_key(name, tensor)].append(name)
    kept: dict[str, torch.Tensor] = {}
    for names in groups.values():
        keep = _preferred_name(names, tied_targets) if len(names) > 1 else names[0]
        if len(names) > 1:
            dropped = sorted(n for n in names if n != keep)
            logger.info("%s share one tensor: saving it as %s only", ", ".join(sorted(names)), keep)
            logger.debug("dropped tied names %s", dropped)
        kept[keep] = state[keep]
    return kept


def _view_key(name: str, tensor: torch.Tensor) -> tuple[Any, ...]:
    if tensor.numel() == 0:  # empty tensors may all report a null data pointer
        return ("empty", name)
    ptr = tensor.untyped_storage().data_ptr()
    return (ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _preferred_name(names: Iterable[str], tied_targets: TiedTargets) -> str:
    """The name to keep: not a tied-weights target of the model class if possible, then the first sorted."""
    ordered = sorted(names)
    sources = [n for n in ordered if not any(p.fullmatch(n) for p in tied_targets())]
    return (sources or ordered)[0]


def _tied_weight_targets(model_dir: Path) -> list[re.Pattern[str]]:
    """Names (patterns) that the model class re-ties to another weight at load time."""
    try:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    import transformers

    patterns: list[re.Pattern[str]] = []
    for arch in architectures:
        try:
            keys = getattr(getattr(transformers, arch), "_tied_weights_keys", None) or ()
        except (AttributeError, ImportError, RuntimeError):
            continue
        # transformers 5: {target: source}; 4.x: [target, ...]
        for key in keys.keys() if isinstance(keys, Mapping) else keys:
            patterns.append(_compile(key))
    return patterns


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error:
        return re.compile(re.escape(pattern))


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, each with its own memory (safetensors refuses overlapping views)."""
    users: dict[int, int] = defaultdict(int)
    for t in tensors.values():
        if t.numel():
            users[t.untyped_storage().data_ptr()] += 1
    out = {}
    for name, t in tensors.items():
        c = t.contiguous()
        if c.numel() and c.data_ptr() == t.data_ptr() and users[t.untyped_storage().data_ptr()] > 1:
            c = c.clone()  # still a view into memory that another saved name uses
        out[name] = c
    return out


def _save_safetensors(tensors: dict[str, torch.Tensor], target: Path) -> None:
    from safetensors.torch import save_file

    tmp = target.with_name(f".{target.name}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=ST_METADATA)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _verify(target: Path, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Read `target` back and compare every tensor bit for bit with what was meant to be saved."""
    from safetensors import safe_open

    with safe_open(str(target), framework="pt", device="cpu") as f:
        names = set(f.keys())
        bad = sorted(n for n in names & tensors.keys() if not _same_tensor(f.get_tensor(n), tensors[n]))
    bad += sorted(names ^ tensors.keys())
    if bad:
        target.unlink(missing_ok=True)
        raise ValueError(f"converting {source} to {target} failed: tensors differ after saving: {bad[:5]}")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal on the raw bytes, so that NaNs compare equal to themselves)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return torch.equal(raw(a), raw(b))


def _write_json_atomically(path: Path, obj: dict[str, Any]) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# --- fast tokenizer -------------------------------------------------------------------------------


def convert_to_fast_tokenizer(model_dir: Path, output_path: str | Path | None = None) -> Path:
    """Write the fast tokenizer of `model_dir` (tokenizer.json + config files) to `output_path`
    (default: `model_dir`); returns that directory.

    In `model_dir` itself only tokenizer.json and files that do not exist yet are written: the
    model's own tokenizer configuration is kept.
    """
    model_dir = Path(model_dir)
    out = Path(output_path) if output_path is not None else model_dir
    tokenizer = _load_fast_tokenizer(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    keep_existing = out.resolve() == model_dir.resolve()
    with tempfile.TemporaryDirectory(prefix=".tokenizer-", dir=out) as tmp:
        tokenizer.save_pretrained(tmp)
        _fix_tokenizer_config(Path(tmp) / TOKENIZER_CONFIG)
        _move_files(Path(tmp), out, keep_existing=keep_existing)
    if not (out / TOKENIZER_FILE).is_file():
        raise ValueError(f"the tokenizer of {model_dir} did not write a {TOKENIZER_FILE}")
    logger.info("wrote a fast tokenizer (%s) for %s into %s", TOKENIZER_FILE, model_dir, out)
    return out


def _load_fast_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load a tokenizer from {model_dir}: {first_line(exc)}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"the tokenizer of {model_dir} ({type(tokenizer).__name__}) has no fast version to write "
            f"a {TOKENIZER_FILE} from"
        )
    return tokenizer


def _fix_tokenizer_config(path: Path) -> None:
    """Make a transformers-5 tokenizer_config.json loadable by older readers too."""
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    changed = False
    if config.get("tokenizer_class") == GENERIC_FAST_TOKENIZER_V5:
        config["tokenizer_class"] = GENERIC_FAST_TOKENIZER
        changed = True
    for key in LOAD_TIME_TOKENIZER_KEYS:
        changed |= config.pop(key, None) is not None
    if changed:
        path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _move_files(src: Path, dst: Path, *, keep_existing: bool) -> None:
    for file in sorted(src.iterdir()):
        target = dst / file.name
        if keep_existing and file.name != TOKENIZER_FILE and (target.exists() or target.is_symlink()):
            logger.debug("keeping the existing %s", target)
            continue
        os.replace(file, target)  # replaces a symlink itself, never the blob it points to
