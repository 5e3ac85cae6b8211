"""DeepSpeed set-up: the process group (also with no launcher) and the engine configuration."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from turnopd.config import TrainerConfig

# The shared-memory comm op compiles on first use (about a minute): keep it in one cached folder per
# Python environment. Two environments (the main install and the vLLM one) compile with different
# include paths, so a shared folder made each rebuild it over the other's on every start.
TORCH_EXTENSIONS_DIR = (Path.home() / ".cache" / "turnopd" / "torch_extensions"
                        / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12])

# Keys TurnOPD owns. The optimizer is a torch AdamW instance (an optimizer in the config would
# JIT-compile fused_adam for minutes), the schedule is TurnOPD's, and micro-batches are packed by
# token count with one optimizer step per call (so no fixed batch sizes or accumulation steps).
OWNED_KEYS = {
    "optimizer": "trainer.lr / weight_decay / betas",
    "scheduler": "trainer.lr_schedule / lr_warmup_steps",
    "train_batch_size": "trainer.micro_batch_tokens",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_tokens",
    "gradient_accumulation_steps": "trainer.micro_batch_tokens",
    "gradient_clipping": "trainer.grad_clip",
    "fp16": "trainer.dtype (float32 or bfloat16)",
    "bf16": "trainer.dtype",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group() -> None:
    """Join (or create) the process group DeepSpeed uses: gloo on CPU, the accelerator's backend
    (nccl) on GPU. Without a launcher this process becomes rank 0 of 1 (DeepSpeed would otherwise
    try MPI discovery and fail)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR))
    if not torch.cuda.is_available():  # say it, instead of DeepSpeed's probe warning on every start
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    backend = "gloo" if accelerator.device_name() == "cpu" else accelerator.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    atexit.unregister(destroy_process_group)  # once, however often the group is joined
    atexit.register(destroy_process_group)


def destroy_process_group() -> None:
    """Leave the process group while the interpreter is still whole (registered at exit).

    gloo's worker threads drop their last reference to a finished collective after the caller has
    moved on, and that drop decrefs Python tensors, so it needs the GIL. If the main thread goes
    straight from the last collective into interpreter finalization, the worker asks for the GIL
    too late and the process aborts ("terminate called without an active exception", SIGABRT) after
    a run that finished. A short GIL-free wait lets the workers finish first (no barrier: a rank
    leaving on an error must not wait for peers still in a collective).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    time.sleep(0.2)
    torch.distributed.destroy_process_group()


def load_overrides(value: Any) -> dict[str, Any]:
    """trainer.deepspeed: None, a mapping, or the path of a DeepSpeed JSON file."""
    if value is None:
        return {}
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"trainer.deepspeed: DeepSpeed config file not found: {path}")
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    if not isinstance(value, Mapping):
        raise TypeError(f"trainer.deepspeed must be a mapping or a JSON path, got {type(value).__name__}")
    return json.loads(json.dumps(value))  # plain nested dicts (also from an OmegaConf mapping)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) \
            else value
    return out


def deepspeed_config(cfg: TrainerConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The engine config: ZeRO stage, precision, clipping, one micro-batch per backward; the
    trainer.deepspeed block is merged over it (any key but the ones TurnOPD owns)."""
    overrides = load_overrides(cfg.deepspeed)
    owned = sorted(set(overrides) & set(OWNED_KEYS))
    if owned:
        raise ValueError("trainer.deepspeed must not set " + "; ".join(
            f"'{key}' (use {OWNED_KEYS[key]})" for key in owned))
    stage = overrides.get("zero_optimization", {}).get("stage", cfg.zero_stage)
    if stage != cfg.zero_stage:
        raise ValueError(f"trainer.zero_stage={cfg.zero_stage} but trainer.deepspeed sets "
                         f"zero_optimization.stage={stage}; set trainer.zero_stage only")
    bf16 = dtype == torch.bfloat16
    base: dict[str, Any] = {
        # One sample per backward and no DeepSpeed-side accumulation: the trainer marks the
        # accumulation boundary itself, since the number of micro-batches varies per step.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        # bf16 keeps fp32 master weights; check_grad_overflow makes the bf16 optimizers skip a step
        # whose gradient norm is not finite (the NaN guard).
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16 and cfg.zero_stage > 0:  # ZeRO accumulates bf16 gradients in fp32 (stage 0 cannot)
        base["data_types"] = {"grad_accum_dtype": "fp32"}
    return _merge(base, overrides)
