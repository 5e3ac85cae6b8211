"""`env.pool: ray`: the env pool's workers as Ray actors, placed by Ray on any node of a cluster.

Each worker is an actor hosting the `WorkerEnvs` a local worker process runs, started with the
resource request of `env.ray` (`num_cpus`, `resources`), so Ray puts it on a node that has them. The
pool (envs.pool.EnvPool) is the same: slots, requests, restarts. A request is a call of the slot's
actor, which answers its calls one at a time in the order they were sent; each answer comes back
through the call's future. A dead actor (its process killed, its node lost) fails its calls with
a RayActorError: the pool replaces it (a new actor of the same request) as it restarts a dead local
worker; a hung one is killed (`ray.kill`) and replaced after `env.step_timeout_s`.

`env.ray.address` joins a running cluster ("auto", "ray://HOST:10001", the head's "HOST:6379"); without
one a local cluster is started for the pool, with room for its actors, and stopped when the pool
closes. Every node runs the same Python environment, this project installed, and holds the env's
data at the same path.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import re
from collections.abc import Iterator
from typing import Any

import ray

from envs.base import EnvSpec
from envs.workers import WorkerEnvs

CLOSE_TIMEOUT_S = 5.0  # an actor's graceful close, before it is killed


class EnvActor(WorkerEnvs):
    """One worker's envs in a Ray actor."""

    def where(self) -> tuple[str, int]:
        """The actor's node id and process id."""
        return ray.get_runtime_context().get_node_id(), os.getpid()


def connect(ray_config: Any, num_workers: int) -> bool:
    """Join env.ray.address, or start a local cluster with room for the pool's actors. Returns whether
    this call connected the process (and its pool should disconnect it); a process connected before
    (a user's own driver) is left as it is."""
    if ray.is_initialized():
        return False
    if ray_config.address:
        ray.init(address=ray_config.address)
    else:
        ray.init(address="local", include_dashboard=False,
                 num_cpus=max(os.cpu_count() or 1, math.ceil(num_workers * ray_config.num_cpus)),
                 resources={name: num_workers * amount for name, amount in ray_config.resources.items()})
    return True


def death_reason(w: int, exc: BaseException) -> str:
    """Why env worker w's actor is gone, in words that are the same for every actor that died the same
    way (Ray's message names the actor's id and process, and episodes are counted by their error)."""
    text = str(exc)
    because = re.search(r"The actor is dead because ([^.\n]*)", text)
    detail = because.group(1) if because else f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return f"env worker {w} died (Ray actor: {detail})"


class RayWorkers:
    """envs.pool.Workers as Ray actors."""

    def __init__(self, spec: EnvSpec, num_workers: int, step_latency_s: float = 0.0, *, ray_config: Any):
        self.spec, self.num_workers, self.step_latency_s, self.config = spec, num_workers, step_latency_s, ray_config
        self._owns_connection = connect(ray_config, num_workers)
        self._actor = ray.remote(EnvActor).options(num_cpus=ray_config.num_cpus, resources=dict(ray_config.resources),
                                                   max_restarts=0)
        self._actors: list[Any] = [None] * num_workers
        self._where: list[Any] = [None] * num_workers  # each actor's first call: where it runs
        self._generation = [0] * num_workers  # answers of an earlier generation are a replaced actor's
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        for w in range(num_workers):
            self.start(w)
        self._wait_until_placed()

    def _wait_until_placed(self) -> None:
        ready, _ = ray.wait(self._where, num_returns=self.num_workers, timeout=self.config.start_timeout_s)
        try:
            ray.get(ready)
        except Exception as exc:  # its process failed to start or to import the env (not installed on its node?)
            self.close()
            raise RuntimeError(f"env.pool=ray: an env worker actor failed to start: {exc}") from exc
        if len(ready) == self.num_workers:
            return
        asked = {"CPU": self.config.num_cpus, **self.config.resources}
        self.close()
        raise RuntimeError(
            f"env.pool=ray: {self.num_workers - len(ready)} of {self.num_workers} env worker actors did not start "
            f"within env.ray.start_timeout_s={self.config.start_timeout_s:g} s: each asks for {asked} "
            "(env.ray.num_cpus, env.ray.resources), which the cluster's free resources could not give "
            f"(`ray status` shows them)")

    def start(self, w: int) -> None:
        self._actors[w] = self._actor.remote(self.spec, self.step_latency_s)
        self._where[w] = self._actors[w].where.remote()

    def stop(self, w: int, graceful: bool) -> None:
        self._generation[w] += 1
        if graceful:
            with contextlib.suppress(Exception):
                ray.get(self._actors[w].close.remote(), timeout=CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):  # gone already
            ray.kill(self._actors[w], no_restart=True)
        self._actors[w] = None

    def send(self, w: int, command: str, slot: int, arg: str) -> None:
        generation = self._generation[w]

        def answered(future: Any) -> None:
            try:
                result = future.result()
            except BaseException as exc:  # the actor died (RayActorError), or Ray failed the call
                result = exc
            self._answers.put((w, generation, slot, result))

        self._actors[w].answer.remote(command, slot, arg).future().add_done_callback(answered)

    def end(self, w: int, slots: list[int]) -> None:
        # retrieved, so that an actor dead meanwhile is no "unhandled error" in Ray's log
        self._actors[w].end.remote(slots).future().add_done_callback(lambda future: future.exception())

    def where(self, w: int) -> tuple[str, int]:
        """Worker w's node id and process id."""
        return ray.get(self._where[w])

    def pid(self, w: int) -> int:
        return self.where(w)[1]

    def answers(self, timeout: float) -> Iterator[tuple[int, int | None, Any]]:
        try:
            items = [self._answers.get(timeout=timeout)]
        except queue.Empty:
            return
        while not self._answers.empty():
            items.append(self._answers.get())
        for w, generation, slot, result in items:
            if w is None or generation != self._generation[w]:  # the wake, or a replaced actor's answer
                continue
            if isinstance(result, BaseException):
                yield w, None, death_reason(w, result)
            else:
                yield w, slot, result

    def wake(self) -> None:
        self._answers.put((None, 0, None, None))

    def close(self) -> None:
        live = [w for w in range(self.num_workers) if self._actors[w] is not None]
        closing = [self._actors[w].close.remote() for w in live]
        with contextlib.suppress(Exception):
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_TIMEOUT_S)
        for w in live:
            self.stop(w, graceful=False)
        if self._owns_connection:
            ray.shutdown()
