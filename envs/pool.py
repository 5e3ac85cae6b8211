"""Episodes stepped in parallel in long-lived worker processes.

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
reads the workers' answers and watches for crashes and hangs.

`step_latency_s` adds a fixed wait to every reset and step, inside the worker, so that a fast local
env stands in for a costly one (a remote web or code sandbox that takes seconds per step and keeps
its machine busy meanwhile): the worker serves nothing else while it waits, as one sandbox would.

Workers are started with the "spawn" method: they import only the env code (and whatever the main
script imports at top level), not the trainer's torch, and nothing inherited from a threaded parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import signal
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

from envs.base import EnvSpec, StepOutcome

JOIN_TIMEOUT_S = 5.0
WATCH_POLL_S = 0.5  # the longest the watcher sleeps between checks for hung workers


def env_error(message: str) -> StepOutcome:
    """The outcome of an episode that the env (not the agent) ended."""
    return StepOutcome(observation="", done=True, won=False, info={"env_error": message})


def _worker(conn: Connection, spec: EnvSpec, step_latency_s: float = 0.0) -> None:
    """Worker loop: ("reset", [(slot, task_id)]) / ("step", [(slot, action)]) answer one (slot,
    outcome) message per item as soon as that item is done; ("end", [slot]) closes those slots'
    games (an episode the caller stops early); ("close", None) ends the worker. A slot's game is also
    closed when its episode ends, so a finished episode holds no memory."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C and a scheduler's stop are for the main process,
        signal.signal(signum, signal.SIG_IGN)       # which closes us at its next safe point
    envs: dict[int, Any] = {}
    while True:
        try:
            command, items = conn.recv()
        except EOFError:  # the main process is gone without closing us: nothing left to answer
            break
        if command == "close":
            break
        if command == "end":
            for slot in items:
                if slot in envs:
                    envs[slot].close()
            continue
        for slot, arg in items:
            if step_latency_s:
                time.sleep(step_latency_s)
            try:
                if command == "reset":
                    if slot not in envs:
                        envs[slot] = spec.make()
                    outcome = envs[slot].reset(arg)
                else:
                    outcome = envs[slot].step(arg)
            except Exception as exc:
                outcome = env_error(f"{type(exc).__name__}: {exc}")
            if outcome.done and slot in envs:
                envs[slot].close()
            conn.send((slot, outcome))
    for env in envs.values():
        env.close()


class EnvPool:
    def __init__(self, spec: EnvSpec, num_workers: int = 2, step_timeout_s: float = 60.0,
                 step_latency_s: float = 0.0):
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
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()  # the watcher thread and the callers share the state below
        self._procs: list[Any] = [None] * num_workers
        self._conns: list[Connection | None] = [None] * num_workers
        self._inflight: list[dict[int, tuple[str, Future]]] = [{} for _ in range(num_workers)]
        self._progress_at = [0.0] * num_workers  # when the worker last answered, or got busy
        self._live: set[int] = set()  # slots whose episode has started and not ended
        self._lost: dict[int, str] = {}  # live slots whose worker died: the reason, for their next request
        for w in range(num_workers):
            self._start(w)
        self._closing = False
        self._wake_read, self._wake_write = mp.Pipe(duplex=False)
        self._watcher = threading.Thread(target=self._watch, name=f"{spec.name}-env-pool", daemon=True)
        self._watcher.start()

    @classmethod
    def for_config(cls, spec: EnvSpec, env_config: Any) -> EnvPool:
        """The pool a recipe's `env` block sizes (env.num_workers, env.step_timeout_s,
        env.step_latency_s)."""
        return cls(spec, env_config.num_workers, env_config.step_timeout_s, env_config.step_latency_s)

    # ---- public API ---------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

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
                with contextlib.suppress(OSError):  # a dead worker holds no game
                    self._conns[w].send(("end", ended))

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
        self._wake_write.send_bytes(b"x")
        self._watcher.join(JOIN_TIMEOUT_S)
        for w in range(self.num_workers):
            if self._procs[w] is not None:
                with contextlib.suppress(OSError):  # a dead worker needs no goodbye
                    self._conns[w].send(("close", None))
                self._stop(w, graceful=True)
        for w in range(self.num_workers):
            self._fail_inflight(w, "the env pool was closed")
        self._wake_read.close()
        self._wake_write.close()

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
            with contextlib.suppress(OSError):  # already dead: the watcher sees its pipe read EOF
                self._conns[w].send((command, [(slot, arg)]))
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
        """Deliver the workers' answers; restart a worker that died (its pipe reads end-of-file) or
        has spent more than step_timeout_s on its current request."""
        while True:
            with self._lock:
                if self._closing:
                    return
                conns = {self._conns[w]: w for w in range(self.num_workers)}
            ready = wait([*conns, self._wake_read], timeout=min(WATCH_POLL_S, self.step_timeout_s / 4))
            for conn in ready:
                if conn is self._wake_read:
                    continue
                w = conns[conn]
                try:
                    slot, outcome = conn.recv()
                except (EOFError, OSError):
                    with self._lock:
                        if self._closing or self._conns[w] is not conn:
                            continue
                        self._procs[w].join(JOIN_TIMEOUT_S)  # reap it, for its exit code
                        self._restart(w, f"env worker {w} died (exit code {self._procs[w].exitcode})")
                    continue
                self._deliver(w, slot, outcome)
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
        episodes are gone with the process and fail at their next request."""
        self._stop(w, graceful=False)
        self._start(w)
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

    # ---- worker processes ---------------------------------------------------------------------

    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, self.spec, self.step_latency_s), daemon=True,
                                 name=f"{self.spec.name}-env-{w}")
        proc.start()
        child.close()  # so that the worker's death reads as EOF here
        self._procs[w], self._conns[w] = proc, parent

    def _stop(self, w: int, graceful: bool) -> None:
        proc = self._procs[w]
        if graceful:
            proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(JOIN_TIMEOUT_S)
        self._conns[w].close()
        self._procs[w], self._conns[w] = None, None
