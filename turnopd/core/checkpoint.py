"""Atomic run checkpoints: runs/<name>/checkpoints/step_<k>/ written to a temporary folder, then
renamed, so a crash never leaves a half-written checkpoint that looks complete.

A checkpoint holds the trainer's files (student in Hugging Face format, optimizer, scheduler; see
turnopd.trainer.Trainer.save), the tokenizer, `loop_state.json` (step, training/wall clocks, depth-controller state)
and `rng_<rank>.pt` (Python, NumPy and torch RNG states of each rank).

`rng_<rank>.pt` holds a tensor and plain data only and is loaded with `weights_only=True`, so a
crafted one (a pickle whose __reduce__ calls os.system, say) is refused with CheckpointRefused
instead of run. The RNG files of checkpoints written before held NumPy's state as an array; the NumPy
names that rebuild such an array are allowed, and nothing else. The trainer's files under
`deepspeed/` are read the same way (turnopd.trainer.Trainer.load gives DeepSpeed's loader
`load_plain` with the few DeepSpeed classes its state files name).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from turnopd.core.distributed import rank_and_world
from turnopd.core.faults import disk_full_error, failpoint, is_disk_full

_STEP_DIR = re.compile(r"^step_(\d+)$")
LOOP_STATE = "loop_state.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint file that holds more than tensors and plain data: not loaded, as loading it could run code."""


def rng_state() -> dict[str, Any]:
    """This process's RNG states as a tensor and plain data (what `torch.load(weights_only=True)` reads)."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = (str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached_gaussian))
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])


# What a NumPy uint32 array pickles as (its rebuild function, ndarray, dtype and the uint32 dtype's
# class): the RNG files of older checkpoints hold NumPy's key array so. They build an array, nothing else.
_NUMPY_ARRAY_GLOBALS = [np.empty(0, np.uint32).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_plain(path: Path, allowed: Sequence[Any] = (), map_location: Any = None) -> Any:
    """A torch.save'd file of tensors and plain data (and the `allowed` classes), loaded without
    running code from it."""
    try:
        with torch.serialization.safe_globals([*_NUMPY_ARRAY_GLOBALS, *allowed]):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's own message advises loading with weights_only=False: what must not happen here
        named = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"it names {named.group(1)}" if named else "it is not a pickle of tensors and plain data"
        raise CheckpointRefused(f"{path} was not loaded: {what}, and loading it could run code. TurnOPD writes "
                                "only tensors and plain data there: the file was made or changed by something "
                                "else") from None


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_checkpoint(run_dir: Path, step: int, trainer, tokenizer, loop_state: dict[str, Any],
                    keep_last: int) -> Path:
    """Write checkpoint `step` atomically and delete all but the newest `keep_last`. Called on every
    rank (ZeRO partitions are saved by their owners); rank 0 writes the loop state and renames.

    Complete or absent: the files go to a temporary folder that only a rename puts in place, and a
    checkpoint counts only with its loop state, written last. A folder being replaced or deleted
    is first renamed out of the way, so a kill never leaves a half-deleted one under a step's name.
    A write that fails (a full disk) removes its temporary folder, to give the space back, and
    re-raises; the checkpoints before it are untouched."""
    rank, _ = rank_and_world()
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".tmp-{final.name}")
    if rank == 0:
        _remove_leftovers(final.parent)  # of a run killed while it wrote or deleted a checkpoint
        tmp.mkdir(parents=True)
    _barrier()
    try:
        trainer.save(tmp)
        torch.save(rng_state(), tmp / f"rng_{rank}.pt")
        failpoint("checkpoint.files_written")
        _barrier()
        if rank == 0:
            tokenizer.save_pretrained(tmp)  # the student folder loads with from_pretrained on its own
            with open(tmp / LOOP_STATE, "w", encoding="utf-8") as f:
                json.dump({**loop_state, "step": step}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            failpoint("checkpoint.before_rename")
            if final.exists():  # re-saving the same step (e.g. over a torn one passed over on resume)
                _discard(final)
            os.replace(tmp, final)
    except BaseException as exc:
        full = isinstance(exc, Exception) and is_disk_full(exc, run_dir)  # judged before the space is given back
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full:
            last = list_checkpoints(run_dir)
            what = (f"checkpoint {final.name} could not be written ({type(exc).__name__}: {str(exc)[:200]}); its partial "
                    f"folder was removed, and the last complete checkpoint is "
                    f"{last[-1].name if last else 'none (the run would start over)'}")
            raise disk_full_error(final, what, run_dir) from exc
        raise
    if rank == 0:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            _discard(old)
    _barrier()
    return final


def _discard(folder: Path) -> None:
    """Delete a checkpoint folder: renamed to a hidden name first (atomic), then removed."""
    doomed = folder.with_name(f".old-{folder.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed)


def _remove_leftovers(root: Path) -> None:
    if root.is_dir():
        for leftover in root.glob(".*-step_*"):
            shutil.rmtree(leftover, ignore_errors=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are ignored)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))
             and (p / LOOP_STATE).is_file()]
    return [p for _, p in sorted(found)]


def load_loop_state(ckpt: Path) -> dict[str, Any]:
    with open(ckpt / LOOP_STATE, encoding="utf-8") as f:
        return json.load(f)


def saved_world_size(ckpt: Path) -> int:
    """How many ranks wrote checkpoint `ckpt` (each writes its rng_<rank>.pt)."""
    return len(list(ckpt.glob("rng_*.pt")))


def load_rng(ckpt: Path) -> None:
    rank, _ = rank_and_world()
    set_rng_state(load_plain(ckpt / f"rng_{rank}.pt"))


def restore_checkpoint(run_dir: Path, trainer: Any) -> dict[str, Any] | None:
    """Load the newest checkpoint that reads back into the trainer and return its loop state (a torn
    or corrupted one, say by a full disk or a copy cut short, is passed over with a warning: the one
    before it is complete)."""
    for checkpoint in reversed(list_checkpoints(run_dir)):
        try:
            state = load_loop_state(checkpoint)
            trainer.load(checkpoint)
            load_rng(checkpoint)
            return state
        except Exception as exc:  # noqa: BLE001 - whatever the damage, the previous checkpoint may do
            print(f"warning: checkpoint {checkpoint} cannot be read ({type(exc).__name__}: {str(exc)[:300]}); "
                  "trying the one before it", file=sys.stderr, flush=True)
    return None
