"""The trainer's newest weights in shared memory, for the generator process of the asynchronous modes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.multiprocessing as torch_mp
from torch import nn

from turnopd.loaders.lora import sync_state
from turnopd.rollout import Policy

POLL_S = 1.0  # how often a process blocked on the other one checks that it is still alive
VERSION_POLL_S = 0.02  # how often a generator waiting for newer weights looks at their version
SPAWN = torch_mp.get_context("spawn")


class PeerGone(Exception):
    """The process on the other side of the pipeline has died (or, for the generator, the run is over)."""


class SharedWeights:
    """The trainer's newest student weights in shared memory (a LoRA student's adapter only), with their version. The trainer
    writes them after each optimizer step; the generator copies them into its policy. Both copy
    under `lock`, so the generator never loads half of an update. The version and the other shared
    flags are plain shared integers, read and written without a lock: no process can die holding one."""

    def __init__(self, module: nn.Module, version: int):
        self.tensors = {name: t.detach().to("cpu", copy=True).share_memory_()
                        for name, t in sync_state(module).items()}
        self.dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
        self.version = SPAWN.Value("q", version, lock=False)
        self.lock = SPAWN.Lock()
        self._load_seconds = 0.0  # in the generator process, since take_load_seconds

    @contextmanager
    def locked(self, peer_alive: Callable[[], bool]) -> Iterator[None]:
        """Hold the lock; PeerGone when the other process dies meanwhile (it may hold it forever)."""
        while not self.lock.acquire(timeout=POLL_S):
            if not peer_alive():
                raise PeerGone
        try:
            yield
        finally:
            self.lock.release()

    def write(self, module: nn.Module, version: int) -> None:
        """(trainer, holding the lock) New weights and their version."""
        for name, tensor in sync_state(module).items():
            self.tensors[name].copy_(tensor.detach())
        self.version.value = version

    def wait_for(self, version: int, running: Callable[[], bool]) -> None:
        """(generator) Block until weights of at least `version` are published."""
        while self.version.value < version:
            if not running():
                raise PeerGone
            time.sleep(VERSION_POLL_S)

    def load_into(self, policy: Policy, trainer_alive: Callable[[], bool]) -> None:
        """(generator) Copy the newest weights into the policy, unless it has them already. The
        policy backend makes it wait for a generation batch running in another thread."""
        if self.version.value == policy.weight_version:
            return
        start = time.perf_counter()
        with self.locked(trainer_alive):
            version = self.version.value
            policy.update_weights(self.tensors)
        # The pipeline's version counts the trainer's optimizer steps, not the backend's reloads.
        policy.weight_version = version
        self._load_seconds += time.perf_counter() - start

    def take_load_seconds(self) -> dict[str, float]:
        """(generator) {"weight_sync": seconds spent loading weights since the last call}."""
        seconds, self._load_seconds = self._load_seconds, 0.0
        return {"weight_sync": seconds}
