"""The device this process computes on, decided in one place: every model loader, policy backend,
teacher, sampler and benchmark takes it from `run_device()` unless it is handed another.

Under a launcher (torchrun, deepspeed) each process is one rank and owns GPU number LOCAL_RANK,
the one DeepSpeed's engine trains on: a rank's rollout and teacher models go there too, not all
onto cuda:0. Without CUDA everything runs on the CPU.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import psutil
import torch


def run_device() -> torch.device:
    """cuda:LOCAL_RANK under a launcher when CUDA is available, cuda (the current GPU) without one,
    else cpu."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local_rank)) if local_rank is not None else torch.device("cuda")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (a timer read before this measures only their launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """Best observed FLOP/s of a size^3 matmul in `dtype` on `device` (2 * size^3 flops each): the
    denominator of an MFU, measured in the same run on the device that trains."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up: kernel selection, clocks up
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _peak_resident_kib(pid: int) -> int:
    """A process's peak resident set (Linux's VmHWM), KiB; 0 when it is gone or /proc lacks it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):  # ended between the listing and the read
        pass
    return 0


def peak_memory_mib(device: torch.device) -> dict[str, float]:
    """The memory high-water marks so far, MiB. host: the peak resident set of this process plus that
    of each live process it started (a vLLM engine core, a pipeline's generator, env workers), each
    its own peak, summed: an upper bound of the tree's joint peak (their peaks need not coincide).
    Where /proc is missing (not Linux) only this process's, from getrusage. cuda (on a GPU): the most
    this process's tensors held on `device` (torch's allocator; an engine in another process is not
    in it)."""
    if Path("/proc/self/status").exists():
        me = psutil.Process()
        host = sum(_peak_resident_kib(p.pid) for p in [me, *me.children(recursive=True)]) / 1024
    else:  # ru_maxrss is bytes on macOS, KiB on the other Unixes
        host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
    peaks = {"host": round(host, 1)}
    if device.type == "cuda":
        peaks["cuda"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return peaks


def pin_process_to_local_gpu() -> None:
    """In a process of its own that works for one rank (a pipeline's generator, spawned by the rank's
    process): only the rank's GPU visible, as cuda:0 (LOCAL_RANK 0), so that an engine that takes GPU
    0 (vLLM's in one process) takes the rank's. Call it before anything in the process touches CUDA:
    the driver reads CUDA_VISIBLE_DEVICES once, when it starts."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(int(local_rank) + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(local_rank)]
    os.environ["LOCAL_RANK"] = "0"
