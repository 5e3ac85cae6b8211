"""Episodes stepped in parallel in long-lived env workers: local processes (`env.pool: local`), Ray
actors (`env.pool: ray`, envs.ray_pool), or, for an env that costs nothing to step, envs in this
process (`env.pool: inline`).

Episodes live in slots 0, 1, ...; slot i belongs to worker i % num_workers, which holds one `Env` per
slot and answers its requests one after the other while the other workers do the same. Each reset
or step is its own request, answered as soon as it is done, so the asynchronous rollout engine
steps an episode while others generate (`await reset_slot(...)`, `await step_slot(...)`); the
batch calls `reset(task_ids)` and `step(actions)` (expert demonstrations) are the same requests,
waited for together. The training loop keeps one pool for the whole run.

A worker that crashes, or spends more than `step_timeout_s` on one request, is killed and started
again; every unfinished episode it held ends as failed-by-env (`StepOutcome(done=True, won=False,
info={"env_error": ...})`): the ones in flight at once, the others at their next request. An
exception raised by an env ends only that episode, the same way. A thread of the pool's process
receives the workers' answers and watches for crashes and hangs. All of this is the pool's, whatever
hosts the workers: a `Workers` object only starts, stops and talks to them.

`step_latency_s` adds a fixed wait to every reset and step, inside the worker, so that a fast local
env stands in for a costly one (a remote web or code sandbox that takes seconds per step and keeps
its machine busy meanwhile): the worker serves nothing else while it waits, as one sandbox would.

Local workers are started with the "spawn" method: they import only the env code (and whatever the
main script imports at top level), not the trainer's torch, and nothing inherited from a threaded
parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from envs.base import EnvSpec, StepOutcome
from envs.workers import WorkerEnvs, env_error

JOIN_TIMEOUT_S = 5.0
WATCH_POLL_S = 0.5  # the longest the watcher sleeps between checks for hung workers

# What a worker sends back: (worker, slot, outcome), or (worker, None, why) when it died.
Answer = tuple[int, int | None, StepOutcome | str]


class Workers(Protocol):
    """The pool's workers 0..num_workers-1, each running a `WorkerEnvs`, started when made as
    `cls(spec, num_workers, step_latency_s)`. Only the pool's watcher thread calls `answers`, and
    `start` and `stop` (which restart a worker) holding the pool's lock; `send` and `end` are called
    holding it."""

    def start(self, w: int) -> None: ...
    def stop(self, w: int, graceful: bool) -> None: ...
    def send(self, w: int, command: str, slot: int, arg: str) -> None: ...  # its answer comes from `answers`
    def end(self, w: int, slots: list[int]) -> None: ...  # close those slots' games, no answer
    def pid(self, w: int) -> int: ...

    def answers(self, timeout: float) -> Iterator[Answer]:
        """The answers that came within `timeout` seconds (none: the wait ended), each from the worker
        as it runs now: answers of a worker stopped since are dropped."""

    def wake(self) -> None: ...  # make a waiting `answers` return (the pool is closing)
    def close(self) -> None: ...  # close every worker, gracefully


def _worker(conn: Connection, spec: EnvSpec, step_latency_s: float = 0.0) -> None:
    """Local worker loop: ("reset", [(slot, task_id)]) / ("step", [(slot, action)]) answer one (slot,
    outcome) message per item as soon as that item is done; ("end", [slot]) closes those slots'
    games (an episode the caller stops early); ("close", None) ends the worker."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C and a scheduler's stop are for the main process,
        signal.signal(signum, signal.SIG_IGN)       # which closes us at its next safe point
    envs = WorkerEnvs(spec, step_latency_s)
    while True:
        try:
            command, items = conn.recv()
        except EOFError:  # the main process is gone without closing us: nothing left to answer
            break
        if command == "close":
            break
        if command == "end":
            envs.end(items)
            continue
        for slot, arg in items:
            conn.send((slot, envs.answer(command, slot, arg)))
    envs.close()


class ProcessWorkers:
    """`env.pool: local`: each worker a process of this node, answering over a pipe; its death reads
    as end-of-file there."""

    def __init__(self, spec: EnvSpec, num_workers: int, step_latency_s: float = 0.0):
        self.spec, self.num_workers, self.step_latency_s = spec, num_workers, step_latency_s
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = [None] * num_workers
        self._conns: list[Connection | None] = [None] * num_workers
        self._wake_read, self._wake_write = mp.Pipe(duplex=False)
        for w in range(num_workers):
            self.start(w)

    def start(self, w: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, self.spec, self.step_latency_s), daemon=True,
                                 name=f"{self.spec.name}-env-{w}")
        proc.start()
        child.close()  # so that the worker's death reads as EOF here
        self._procs[w], self._conns[w] = proc, parent

    def stop(self, w: int, graceful: bool) -> None:
        proc = self._procs[w]
        if graceful:
            proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(JOIN_TIMEOUT_S)
        self._conns[w].close()
        self._procs[w], self._conns[w] = None, None

    def send(self, w: int, command: str, slot: int, arg: str) -> None:
        with contextlib.suppress(OSError):  # already dead: its pipe reads EOF in `answers`
            self._conns[w].send((command, [(slot, arg)]))

    def end(self, w: int, slots: list[int]) -> None:
        with contextlib.suppress(OSError):  # a dead worker holds no game
            self._conns[w].send(("end", slots))

    def pid(self, w: int) -> int:
        return self._procs[w].pid

    def answers(self, timeout: float) -> Iterator[Answer]:
        conns = {self._conns[w]: w for w in range(self.num_workers)}
        for conn in wait([*conns, self._wake_read], timeout=timeout):
            if conn is self._wake_read:
                continue
            w = conns[conn]
            if self._conns[w] is not conn:  # restarted since
                continue
            try:
                slot, outcome = conn.recv()
            except (EOFError, OSError):
                self._procs[w].join(JOIN_TIMEOUT_S)  # reap it, for its exit code
                yield w, None, f"env worker {w} died (exit code {self._procs[w].exitcode})"
                continue
            yield w, slot, outcome

    def wake(self) -> None:
        self._wake_write.send_bytes(b"x")

    def close(self) -> None:
        for w in range(self.num_workers):
            if self._procs[w] is not None:
                with contextlib.suppress(OSError):  # a dead worker needs no goodbye
                    self._conns[w].send(("close", None))
                self.stop(w, graceful=True)
        self._wake_read.close()
        self._wake_write.close()


class InlineWorkers:
    """`env.pool: inline`: the workers' envs live in this process and answer each request at once, in
    the caller's thread. For envs that cost nothing to step (a prompt dataset): no process to start,
    no pipe to cross. Nothing isolates a crash or a hang: an exception still ends only its episode,
    but an env that hangs holds the caller."""

    def __init__(self, spec: EnvSpec, num_workers: int, step_latency_s: float = 0.0):
        if step_latency_s:
            raise ValueError("inline env workers answer in the caller's thread, so a step latency would stall "
                             "every episode; use env.pool=local to stand in for a costly env")
        self.spec = spec
        self.envs = [WorkerEnvs(spec) for _ in range(num_workers)]
        self._answers: queue.SimpleQueue[Answer | None] = queue.SimpleQueue()

    def start(self, w: int) -> None:
        self.envs[w] = WorkerEnvs(self.spec)

    def stop(self, w: int, graceful: bool) -> None:
        self.envs[w].close()

    def send(self, w: int, command: str, slot: int, arg: str) -> None:
        self._answers.put((w, slot, self.envs[w].answer(command, slot, arg)))

    def end(self, w: int, slots: list[int]) -> None:
        self.envs[w].end(slots)

    def pid(self, w: int) -> int:
        return os.getpid()

    def answers(self, timeout: float) -> Iterator[Answer]:
        with contextlib.suppress(queue.Empty):
            answer = self._answers.get(timeout=timeout)
            while answer is not None:  # None: a wake-up
                yield answer
                answer = self._answers.get_nowait()

    def wake(self) -> None:
        self._answers.put(None)

    def close(self) -> None:
        for envs in self.envs:
            envs.close()


class EnvPool:
    # the ledger's name for the busy time of its resets and steps (turnopd.rollout.agent_loop.play_episode);
    # a pool whose steps are not the env's names its own (the world-model pool: "world_model")
    ledger_resource = "env"

    def __init__(self, spec: EnvSpec, num_workers: int = 2, step_timeout_s: float = 60.0,
                 step_latency_s: float = 0.0, workers: Callable[[EnvSpec, int, float], Workers] = ProcessWorkers):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        if not 0 <= step_latency_s < step_timeout_s:
            raise ValueError(f"step_latency_s must be in [0, step_timeout_s = {step_timeout_s:g}), "
                             f"got {step_latency_s}")
        self.spec = spec
        self.step_latency_s = step_latency_s
        self.num_workers = num_workers
        self.step_timeout_s = step_timeout_s
        self.restarts = 0  # workers restarted after a crash or hang, over the pool's life
        self._lock = threading.Lock()  # the watcher thread and the callers share the state below
        self._inflight: list[dict[int, tuple[str, Future]]] = [{} for _ in range(num_workers)]
        self._progress_at = [0.0] * num_workers  # when the worker last answered, or got busy
        self._live: set[int] = set()  # slots whose episode has started and not ended
        self._lost: dict[int, str] = {}  # live slots whose worker died: the reason, for their next request
        self.workers = workers(spec, num_workers, step_latency_s)
        self._closing = False
        self._watcher = threading.Thread(target=self._watch, name=f"{spec.name}-env-pool", daemon=True)
        self._watcher.start()

    @classmethod
    def for_config(cls, spec: EnvSpec, env_config: Any) -> EnvPool:
        """The pool a recipe's `env` block makes (env.pool: its workers' hosts; env.num_workers,
        env.step_timeout_s, env.step_latency_s)."""
        workers: Callable[[EnvSpec, int, float], Workers] = ProcessWorkers
        if env_config.pool == "inline":
            workers = InlineWorkers
        if env_config.pool == "ray":
            from envs.ray_pool import RayWorkers

            workers = partial(RayWorkers, ray_config=env_config.ray)
        return cls(spec, env_config.num_workers, env_config.step_timeout_s, env_config.step_latency_s, workers)

    # ---- public API ---------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [self.workers.pid(w) for w in range(self.num_workers)]

    def worker_of(self, slot: int) -> int:
        return slot % self.num_workers

    async def reset_slot(self, slot: int, task_id: str) -> StepOutcome:
        """Start an episode of `task_id` in `slot` (ending the one it held)."""
        return await asyncio.wrap_future(self._submit("reset", slot, task_id))

    async def step_slot(self, slot: int, action: str) -> StepOutcome:
        """Play one action in the slot's episode."""
        return await asyncio.wrap_future(self._submit("step", slot, action))

    def end(self, slots: list[int]) -> None:
        """Stop the unfinished episodes of `slots` (the depth cap ended them): their games are closed."""
        with self._lock:
            for slot in slots:
                self._live.discard(slot)
                self._lost.pop(slot, None)
            by_worker: dict[int, list[int]] = {}
            for slot in slots:
                by_worker.setdefault(self.worker_of(slot), []).append(slot)
            for w, ended in by_worker.items():
                self.workers.end(w, ended)

    def reset(self, task_ids: list[str]) -> list[StepOutcome]:
        """Start one episode per task id in slots 0..len(task_ids)-1; the episodes of other slots end."""
        self.end([slot for slot in self._live if slot >= len(task_ids)])
        outcomes = self._settle({slot: self._submit("reset", slot, task) for slot, task in enumerate(task_ids)})
        return [outcomes[slot] for slot in range(len(task_ids))]

    def step(self, actions: dict[int, str]) -> dict[int, StepOutcome]:
        """Play one action in each given slot (unfinished episodes); wait for all of them."""
        for slot in actions:
            if slot not in self._live:
                raise ValueError(f"slot {slot} has no episode playing (its episode has ended, or none started)")
        return self._settle({slot: self._submit("step", slot, action) for slot, action in actions.items()})

    def close(self) -> None:
        with self._lock:
            self._closing = True
        self.workers.wake()
        self._watcher.join(JOIN_TIMEOUT_S)
        self.workers.close()
        for w in range(self.num_workers):
            self._fail_inflight(w, "the env pool was closed")

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests -----------------------------------------------------------------------------

    def _submit(self, command: str, slot: int, arg: str) -> Future:
        """Send one request to the slot's worker; its Future holds the outcome."""
        future: Future = Future()
        w = self.worker_of(slot)
        with self._lock:
            if command == "step" and slot in self._lost:  # its worker died since its last request
                self._live.discard(slot)
                future.set_result(env_error(self._lost.pop(slot)))
                return future
            if slot in self._inflight[w]:
                raise ValueError(f"slot {slot} has a request in flight already")
            if command == "reset":
                self._lost.pop(slot, None)
                self._live.add(slot)
            elif slot not in self._live:
                raise ValueError(f"slot {slot} has no episode playing (its episode has ended, or none started)")
            if not self._inflight[w]:
                self._progress_at[w] = time.monotonic()
            self._inflight[w][slot] = (command, future)
            self.workers.send(w, command, slot, arg)
        return future

    def _settle(self, futures: dict[int, Future]) -> dict[int, StepOutcome]:
        """Wait for a batch's requests. An answered episode whose worker died later in the same batch
        is gone with that worker: it fails now, not at its next request."""
        outcomes = {slot: future.result() for slot, future in futures.items()}
        with self._lock:
            for slot in futures:
                if slot in self._lost:
                    self._live.discard(slot)
                    outcomes[slot] = env_error(self._lost.pop(slot))
        return outcomes

    # ---- the watcher thread -------------------------------------------------------------------

    def _watch(self) -> None:
        """Deliver the workers' answers; restart a worker that died or has spent more than
        step_timeout_s on its current request."""
        while True:
            with self._lock:
                if self._closing:
                    return
            for w, slot, answer in self.workers.answers(timeout=min(WATCH_POLL_S, self.step_timeout_s / 4)):
                if slot is not None:
                    self._deliver(w, slot, answer)
                    continue
                with self._lock:
                    if not self._closing:
                        self._restart(w, answer)
            now = time.monotonic()
            with self._lock:
                for w in range(self.num_workers):
                    if self._inflight[w] and now - self._progress_at[w] >= self.step_timeout_s and not self._closing:
                        command = next(iter(self._inflight[w].values()))[0]
                        self._restart(w, f"env worker {w} timed out after {self.step_timeout_s:g} s on a {command}")

    def _deliver(self, w: int, slot: int, outcome: StepOutcome) -> None:
        with self._lock:
            _, future = self._inflight[w].pop(slot)
            self._progress_at[w] = time.monotonic()
            if outcome.done:
                self._live.discard(slot)
        if not future.done():  # a caller that stopped waiting (a cancelled episode) cancels it
            future.set_result(outcome)

    def _restart(self, w: int, why: str) -> None:
        """(holding the lock) Restart worker w: its requests in flight fail now; its other unfinished
        episodes are gone with it and fail at their next request."""
        self.workers.stop(w, graceful=False)
        self.workers.start(w)
        self.restarts += 1
        for slot in self._live:
            if self.worker_of(slot) == w and slot not in self._inflight[w]:
                self._lost[slot] = why
        failed = list(self._inflight[w])
        for slot in failed:
            self._live.discard(slot)
        self._fail_inflight(w, why)

    def _fail_inflight(self, w: int, why: str) -> None:
        inflight, self._inflight[w] = self._inflight[w], {}
        for _, future in inflight.values():
            if not future.done():
                future.set_result(env_error(why))
