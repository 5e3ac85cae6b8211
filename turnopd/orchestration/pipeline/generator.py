"""`pipeline.mode: one_step_off` and `pool`: a generator process plays and scores the episodes while
the training process trains (see the package docstring for what each mode plays and when).

Processes: the generator is its own process (torch.multiprocessing, spawn) with its own policy,
teachers and env pools (one per env of the run), and half of the CPU threads (the trainer keeps the rest). Weights travel
through shared-memory tensors (`SharedWeights`), requests through a multiprocessing queue, scored
trajectories back through a pipe that a thread of the training process drains as messages arrive,
so the generator never waits for a step to end to hand its work over. A generator that dies is seen
at once (its pipe reads end-of-file, even in the middle of a message): it is started again, up to
`pipeline.max_generator_restarts` times, and the requests it had not answered are sent again; past
that the run ends with an error that says so. Every wait on the other process also checks that it
is alive (a process killed while holding the weights' lock holds it forever: the lock is replaced
with the process). A request is answered once and taken once, so no trajectory is trained twice.
Nothing queued is checkpointed: a resumed run starts a new generator from the checkpoint's
weights, and what was generated but not trained before the interruption is dropped (this is
logged). The generator is started with "spawn": a script that runs the loop in an asynchronous mode
needs the usual `if __name__ == "__main__":` guard (`turnopd distill` has it).

A multi-env run (recipe key `envs`) is several streams of requests, one per env (EnvStream): each
env's step batches come from its plan in the step's MixturePlan, each env's pool waves are its share
of a wave, queued apart and taken by its share of each step, and each env's waves are requested by
may_request_wave on that env's own counts, so one env's slower episodes never hold another's back.
The generator plays every request in its env's pool with the env's recipe view (episodes of all
envs at once, sharing the policy's generation batches) and scores it with that env's teacher. A
single-env run is one stream: its requests are the ones it always made.
"""

from __future__ import annotations

import asyncio
import queue
import signal
import sys
import threading
import time
import traceback
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch import nn

from teachers import make_teachers, merge_replica_stats, replica_stats
from turnopd.algorithm.controllers import DepthSchedule, EnvDepths
from turnopd.config import RunConfig
from turnopd.core.device import pin_process_to_local_gpu
from turnopd.core.distributed import rank_and_world
from turnopd.core.ledger import Ledger
from turnopd.core.types import Trajectory
from turnopd.loaders.hf_models import load_student
from turnopd.loaders.screens import HeldScreens, attach_run_screens
from turnopd.models.screen_reader import reader_for
from turnopd.orchestration.pipeline.base import PIPELINE_MODES, PipelineMode, PipelineStats
from turnopd.orchestration.pipeline.mixture import EnvPools, MixturePlan, env_parts, env_plans, open_pools
from turnopd.orchestration.pipeline.plan import (
    BatchPlan,
    Episodes,
    score,
    step_episodes,
    teacher_tokenizer,
    wave_episodes,
)
from turnopd.orchestration.pipeline.shared_weights import (
    POLL_S,
    SPAWN,
    PeerGone,
    SharedWeights,
)
from turnopd.orchestration.preflight import Setup
from turnopd.rollout import make_policy
from turnopd.rollout.agent_loop import SlotPool, play_episode

JOIN_TIMEOUT_S = 60.0  # for the generator to finish its current request when the run ends


@dataclass(frozen=True)
class GenerationRequest:
    """Play these episodes of env `env` with weights at least `min_version` new. A pool `wave` loads
    newer weights between generation calls and feeds the env's queue; otherwise the answer is one
    step's batch of that env."""

    id: int
    env: str
    episodes: Episodes
    min_version: int
    wave: bool


@dataclass
class Produced:
    """A request's scored trajectories, and the generator's own phases (startup, idle, weight_sync),
    busy seconds per resource (generation, env, teacher) and teacher replica stats since its
    previous answer."""

    request_id: int
    trajectories: list[Trajectory]
    phases: dict[str, float]
    busy: dict[str, float]
    teacher_replicas: dict[str, Any]
    # a time.time() before which no request the generator is still answering began (when it sent
    # this): the screenshots older than that and not in a received trajectory are no episode's
    answering_since: float


@dataclass
class GeneratorFailed:
    """The generator raised (a restart would fail the same way): its traceback."""

    traceback: str


@dataclass
class GeneratorExited:
    """The pipe of generator number `generator` read end-of-file: that process is gone."""

    generator: int


class GeneratorError(RuntimeError):
    """The generator process failed or died more often than `pipeline.max_generator_restarts`."""


def _next_request(requests: Any, stop: Any, trainer: Any) -> GenerationRequest | None:
    """The next request, or None when the run is over (told to stop, or the trainer is gone)."""
    while True:
        try:
            request = requests.get(timeout=POLL_S)
            return None if stop.value else request
        except queue.Empty:
            if not trainer.is_alive():
                return None


def _generator_main(cfg: RunConfig, setup: Setup, weights: SharedWeights, requests: Any,
                    results: Connection, stop: Any, threads: int) -> None:
    """The generator process: answers requests until the run is over."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C and a scheduler's stop are for the training
        signal.signal(signum, signal.SIG_IGN)       # process, which stops us at its next safe point
    pin_process_to_local_gpu()  # before any engine: rank r's generator uses rank r's GPU
    torch.set_num_threads(threads)
    trainer = torch_mp.parent_process()
    ledger = Ledger()
    try:
        with ExitStack() as stack:
            with ledger.phase("startup"):
                teachers = make_teachers(setup.teacher_specs)
                if cfg.student.lora is None:
                    policy = make_policy(cfg.policy, str(setup.student_path), dtype=weights.dtype, seed=cfg.seed)
                else:  # the weights it is sent are the adapter's: it generates with a LoRA model of its own
                    student, tokenizer = load_student(setup.student_path, weights.dtype, cfg.student.lora)
                    policy = make_policy(cfg.policy, student, tokenizer=tokenizer, dtype=weights.dtype, seed=cfg.seed)
                policy.weight_version = -1  # the folder's weights, not yet the trainer's
                attach_run_screens(setup.spec, setup.student_path, policy, teachers,  # an env of screenshots
                                   reader_for(cfg.student))
                pools = stack.enter_context(open_pools(cfg, setup))  # one per env of the run
            asyncio.run(_serve(cfg, setup, weights, requests, results, stop, trainer, ledger, policy, pools,
                               teachers))
    except (PeerGone, BrokenPipeError):
        return  # the run is over, or the training process is gone: nobody to answer
    except Exception:
        results.send(GeneratorFailed(traceback.format_exc()))


def generator_slots(cfg: RunConfig) -> int:
    """Episodes the generator plays at once (this rank's share): a pool wave's, a step's or a probe
    batch's, whichever is largest; a finished episode's slot goes to the next waiting episode."""
    rank, world = rank_and_world()
    sizes = (cfg.pipeline.wave_episodes or cfg.trainer.episodes_per_step, cfg.trainer.episodes_per_step,
             cfg.depth.num_probes or cfg.trainer.episodes_per_step)
    return max(len(range(rank, n, world)) for n in sizes)


async def _serve(cfg: RunConfig, setup: Setup, weights: SharedWeights, requests: Any,
                 results: Connection, stop: Any, trainer: Any, ledger: Ledger, policy: Any, pools: EnvPools,
                 teachers: dict[str, Any]) -> None:
    """Answer each request in a task of its own as it comes (the next one may start while earlier
    ones play, of any env), the episodes of an env sharing `generator_slots` slots of its env pool and
    playing with its recipe view. Newer published weights are loaded before each generation batch (the
    pool never stops for a sync)."""
    loop = asyncio.get_running_loop()
    parts = env_parts(cfg, setup)
    slots = {env: SlotPool(generator_slots(view)) for env, (view, _) in parts.items()}
    policy.before_batch = lambda: weights.load_into(policy, trainer.is_alive)
    answering: set[asyncio.Task] = set()
    began: dict[int, float] = {}  # request id -> when its answer began (time.time()), until it is sent

    def running() -> bool:
        return trainer.is_alive() and not stop.value

    async def play(request: GenerationRequest, episode: int, task: str) -> Trajectory:
        view, part = parts[request.env]
        async with slots[request.env].slot() as slot:
            return await play_episode(part.spec, pools[request.env], policy, task, slot=slot, episode=episode,
                                      env_config=view.env, sampling=request.episodes.sampling,
                                      turn_limit=request.episodes.turn_limits[episode],
                                      is_probe=episode < request.episodes.probes, ledger=ledger, prompt=view.prompt,
                                      teacher_tokenizer=teacher_tokenizer(cfg, teachers, request.env))

    async def answer(request: GenerationRequest) -> None:
        began[request.id] = time.time()
        try:
            with ledger.busy("answering"):
                # probes (and one_step_off batches) wait for the weights of their step
                await loop.run_in_executor(None, weights.wait_for, request.min_version, running)
                await loop.run_in_executor(None, weights.load_into, policy, trainer.is_alive)
                trajectories = list(await asyncio.gather(*(play(request, i, task)
                                                           for i, task in enumerate(request.episodes.tasks))))
                with ledger.busy("teacher"):
                    await loop.run_in_executor(None, score, cfg, teachers, trajectories)
            phases = ledger.end_step()  # the generator's startup, if this is its first answer
            busy = dict(ledger.last_busy)
            phases["idle"] = max(0.0, ledger.last_step_time_s - busy.pop("answering", 0.0))
            del began[request.id]  # its trajectories go with the message: the trainer holds their screenshots
            results.send(Produced(request.id, trajectories, {**phases, **weights.take_load_seconds()}, busy,
                                  replica_stats(teachers), min(began.values(), default=time.time())))
        except (PeerGone, BrokenPipeError, asyncio.CancelledError):
            return  # the run is over, or the training process is gone: nobody to answer
        except Exception:
            results.send(GeneratorFailed(traceback.format_exc()))
        finally:
            began.pop(request.id, None)

    while (request := await loop.run_in_executor(None, _next_request, requests, stop, trainer)) is not None:
        task = loop.create_task(answer(request))
        answering.add(task)
        task.add_done_callback(answering.discard)
    for task in list(answering):
        task.cancel()


def _drain(results: Connection, inbox: queue.SimpleQueue, generator: int) -> None:
    """Move the generator's answers into `inbox` as they arrive, then report its end (end-of-file,
    also in the middle of a message: the training process holds no copy of the writing end)."""
    try:
        while True:
            inbox.put(results.recv())
    except (EOFError, OSError):
        inbox.put(GeneratorExited(generator))


def exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def take_fresh(fifo: deque[Trajectory], n: int, version: int,
               max_staleness: int) -> tuple[list[Trajectory], int]:
    """Up to n trajectories from the front of `fifo` (oldest first), dropping every one more than
    `max_staleness` versions older than `version`. Returns (taken, number dropped)."""
    taken, dropped = [], 0
    while fifo and len(taken) < n:
        traj = fifo.popleft()
        if version - traj.weight_version > max_staleness:
            dropped += 1
        else:
            taken.append(traj)
    return taken, dropped


def may_request_wave(requested: int, wave: int, batch: int, version: int, max_staleness: int,
                     train_steps: Sequence[int]) -> bool:
    """pool: may the trainer, at weight `version`, request a wave of `wave` more episodes when
    `requested` are requested already (not counting dropped ones)?

    Queued trajectories are trained oldest first, `batch` per step, on the non-probe steps
    `train_steps` (ascending), so trajectory n (0-based) is trained at step train_steps[n // batch].
    A wave starts at `version` or later, so it is fresh enough when the last of its trajectories
    that a step takes is trained at most `max_staleness` steps after `version`. The steps up to
    `version` come first: while they lack trajectories a wave is always requested (the trainer is
    waiting; whatever turns out too old is dropped). Nothing is requested past the last step.
    """
    needed = len(train_steps) * batch
    if requested >= needed:
        return False
    if requested < bisect_right(train_steps, version) * batch:
        return True
    last = min(requested + wave, needed) - 1
    return train_steps[last // batch] - version <= max_staleness


@dataclass
class _Generator:
    """A running generator process and its request queue (replaced whole on a restart)."""

    number: int
    process: Any
    requests: Any


@dataclass
class EnvStream:
    """One env's requests on the trainer's side (a single-env run has one): its recipe view and training
    tasks, its non-probe steps (the ones a pool step fills from its queue), this rank's share of its
    episodes a step, and its pool waves: their cap, their queue, how many were requested and their
    episodes (less the dropped ones)."""

    cfg: RunConfig
    train_tasks: list[str]
    train_steps: list[int]
    batch: int
    wave_cap: int
    fifo: deque[Trajectory] = field(default_factory=deque)
    waves: int = 0
    wave_requested: int = 0


def env_streams(cfg: RunConfig, setup: Setup, depth: DepthSchedule | EnvDepths, start_step: int) -> dict[str, EnvStream]:
    """Each env's stream, by env name, its waves at first at its horizon. A pool's queue is emptied by
    the steps that do not probe (probes_at depends on the step only)."""
    rank, world = rank_and_world()
    schedules = depth.schedules if isinstance(depth, EnvDepths) else {cfg.env.name: depth}
    streams = {}
    for env, (view, part) in env_parts(cfg, setup).items():
        episodes = view.trainer.episodes_per_step
        train_steps = [s for s in range(start_step, cfg.trainer.steps) if not schedules[env].probes_at(s, episodes)]
        streams[env] = EnvStream(view, part.train_tasks, train_steps, len(range(rank, episodes, world)),
                                 view.env.max_turns)
    return streams


class GeneratorRollouts:
    """one_step_off and pool: batches played and scored by a generator process (module docstring)."""

    def __init__(self, cfg: RunConfig, setup: Setup, weights: SharedWeights, ledger: Ledger, *,
                 start_step: int, streams: dict[str, EnvStream]):
        self.cfg, self.setup, self.weights, self.ledger = cfg, setup, weights, ledger
        self.mode, self.start_step, self.streams = cfg.pipeline.mode, start_step, streams
        self.rank, self.world = rank_and_world()
        self.stop = SPAWN.Value("b", False, lock=False)
        self.pending: dict[int, GenerationRequest] = {}  # sent, not answered yet: sent again after a restart
        self.answers: dict[int, Produced] = {}  # answered step batches (and probes), not taken yet
        self.step_requests: dict[tuple[int, str], int] = {}  # (step, env) -> the request for its batch
        self.restarts = 0
        self._next_id = 0
        self._stats = PipelineStats(self.mode)
        self._replica_stats: dict[str, Any] = {}  # the generator's, since the last take_replica_stats
        self._answering_since = time.time()  # no request is answered before the generator starts
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # One core each on a 2-core machine: the generator takes half the threads, the trainer the rest.
        self._threads_before = torch.get_num_threads()
        self._generator_threads = max(1, self._threads_before // 2)
        torch.set_num_threads(max(1, self._threads_before - self._generator_threads))
        self._generator = self._start_generator(0)
        if start_step:
            print(f"pipeline {self.mode}: resuming at step {start_step} with a new generator and the "
                  "checkpoint's weights; trajectories generated but not trained before the interruption were "
                  "not checkpointed and are dropped", file=sys.stderr)

    # ---- the loop's calls ---------------------------------------------------------------------

    def take(self, plan: BatchPlan | MixturePlan) -> list[Trajectory]:
        """The step's trajectories, each env's share in recipe order (every env's requested first: a
        step not prepared, the first of a (resumed) run, plays its envs at once)."""
        plans = env_plans(self.cfg, plan)
        for env, env_plan in plans.items():
            self._follow_plan(env, env_plan)
            if self._by_step(env_plan) and (plan.step, env) not in self.step_requests:
                self._request_step(env, env_plan)
        version = self.weights.version.value
        trajectories, dropped = [], 0
        for env, env_plan in plans.items():
            taken, dropped_now = self._take_env(env, env_plan, version)
            trajectories += taken
            dropped += dropped_now
        staleness = [version - t.weight_version for t in trajectories]
        self._stats = PipelineStats(
            self.mode, weight_version=version, staleness_max=max(staleness, default=0),
            staleness_mean=sum(staleness) / max(len(staleness), 1), dropped_stale=dropped,
            queued=self._untrained(), generator_restarts=self.restarts)
        return trajectories

    def prepare(self, plan: BatchPlan | MixturePlan) -> None:
        for env, env_plan in env_plans(self.cfg, plan).items():
            self._follow_plan(env, env_plan)
            if self._by_step(env_plan):
                self._request_step(env, env_plan)
        self._top_up()

    def publish(self, weights: nn.Module, version: int) -> None:
        while True:
            try:
                with self.weights.locked(self._generator.process.is_alive):
                    self.weights.write(weights, version)
                break
            except PeerGone:  # it died, maybe holding the lock
                self._await_restart()
        self._top_up()  # a newer version lets more waves stay fresh

    def stats(self) -> PipelineStats:
        return self._stats

    def take_replica_stats(self) -> dict[str, Any]:
        taken, self._replica_stats = self._replica_stats, {}
        return taken

    def close(self) -> None:
        self.stop.value = True
        self._generator.requests.put(None)  # wakes a waiting generator
        self._generator.process.join(JOIN_TIMEOUT_S)
        if self._generator.process.is_alive():
            self._generator.process.kill()
            self._generator.process.join(JOIN_TIMEOUT_S)
        self._poll()
        untrained = self._untrained()
        if untrained or self.pending:
            print(f"pipeline {self.mode}: run over with {untrained} trajectories generated and not trained, "
                  f"and {len(self.pending)} requests unanswered (dropped)", file=sys.stderr)
        torch.set_num_threads(self._threads_before)

    def held_screens(self) -> HeldScreens:
        """What freeing screenshots must keep now (an env of screenshots): those of the trajectories
        received and not trained, and those put since the generator's oldest unfinished answer began
        (its newest report; a request it has not picked up yet begins later)."""
        self._poll()
        received = [t for s in self.streams.values() for t in s.fifo] + [
            t for answer in self.answers.values() for t in answer.trajectories]
        return HeldScreens(self._answering_since,
                           frozenset(key for t in received for turn in t.turns for key in turn.image_keys))

    @property
    def generator_pid(self) -> int:
        return self._generator.process.pid

    # ---- requests and answers -----------------------------------------------------------------

    def _by_step(self, plan: BatchPlan) -> bool:
        """Whether an env's share of a step is requested as a batch of its own (a probe step, and every
        step of one_step_off) rather than taken from the env's pool queue."""
        return plan.is_probe_step or self.mode == "one_step_off"

    def _take_env(self, env: str, plan: BatchPlan, version: int) -> tuple[list[Trajectory], int]:
        """One env's share of the step: its batch's answer, or (pool) the oldest fresh trajectories of its
        queue. Returns (them, the number dropped as too old)."""
        if self._by_step(plan):
            request_id = self.step_requests.pop((plan.step, env))
            self._wait(lambda: request_id in self.answers)
            return self.answers.pop(request_id).trajectories, 0
        stream, trajectories, dropped = self.streams[env], [], 0
        share = len(range(self.rank, plan.episodes, self.world))  # fewer than a batch: trainer.budget's last step
        while len(trajectories) < share:
            self._top_up()
            self._wait(lambda: bool(stream.fifo))
            taken, dropped_now = take_fresh(stream.fifo, share - len(trajectories), version,
                                            self.cfg.pipeline.max_staleness)
            trajectories += taken
            dropped += dropped_now
            stream.wave_requested -= dropped_now  # their places in the step order go to later ones
        return trajectories, dropped

    def _untrained(self) -> int:
        """Trajectories generated and received, not taken by a step yet."""
        return sum(len(s.fifo) for s in self.streams.values()) + sum(len(a.trajectories) for a in self.answers.values())

    def _follow_plan(self, env: str, plan: BatchPlan) -> None:
        """pool: an env's waves requested from now on play at its plan's cap (a wave carries its turn
        limits from its request, as a step's batch carries its plan's)."""
        if not plan.is_probe_step:
            self.streams[env].wave_cap = plan.cap

    def _request_step(self, env: str, plan: BatchPlan) -> None:
        """One env's batch of one step: probes wait for the step's own weights, one_step_off rollouts
        for the previous step's (the newest when the request is made)."""
        stream = self.streams[env]
        episodes = step_episodes(stream.cfg, stream.train_tasks, plan)
        min_version = plan.step if plan.is_probe_step else plan.step - 1
        self.step_requests[plan.step, env] = self._send(env, episodes, min_version, wave=False)

    def _top_up(self) -> None:
        """pool: request each env's waves while they may be (may_request_wave, on the env's own counts)."""
        if self.mode != "pool":
            return
        for env, stream in self.streams.items():
            while True:
                episodes = wave_episodes(stream.cfg, stream.train_tasks, self.start_step, stream.waves, stream.wave_cap)
                version, bound = self.weights.version.value, self.cfg.pipeline.max_staleness
                if not may_request_wave(stream.wave_requested, len(episodes.tasks), stream.batch, version, bound,
                                        stream.train_steps):
                    break
                self._send(env, episodes, min_version=0, wave=True)
                stream.waves += 1
                stream.wave_requested += len(episodes.tasks)

    def _send(self, env: str, episodes: Episodes, min_version: int, wave: bool) -> int:
        request = GenerationRequest(self._next_id, env, episodes, min_version, wave)
        self._next_id += 1
        self.pending[request.id] = request
        self._generator.requests.put(request)
        return request.id

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Handle answers until `ready()`; time spent blocked is the trainer's idle time."""
        self._poll()
        if ready():
            return
        with self.ledger.phase("trainer_idle"):
            while not ready():
                self._handle(self._inbox.get())

    def _poll(self) -> None:
        """Handle the answers that have arrived, without waiting."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: Produced | GeneratorFailed | GeneratorExited) -> None:
        if isinstance(message, GeneratorFailed):
            raise GeneratorError(f"the generator process failed:\n{message.traceback}")
        if isinstance(message, GeneratorExited):
            if message.generator == self._generator.number and not self.stop.value:
                self._restart()
            return
        self.ledger.add_generator(message.phases, message.busy)
        self._replica_stats = merge_replica_stats(self._replica_stats, message.teacher_replicas)
        self._answering_since = message.answering_since
        request = self.pending.pop(message.request_id)
        if request.wave:
            self.streams[request.env].fifo.extend(message.trajectories)
        else:
            self.answers[request.id] = message

    # ---- the process --------------------------------------------------------------------------

    def _start_generator(self, number: int) -> _Generator:
        receiving, sending = SPAWN.Pipe(duplex=False)
        requests = SPAWN.Queue()
        process = SPAWN.Process(target=_generator_main, name=f"turnopd-generator-{number}", args=(
            self.cfg, self.setup, self.weights, requests, sending, self.stop,
            self._generator_threads))
        process.start()
        sending.close()  # the generator holds the only writing end: its death reads as end-of-file
        threading.Thread(target=_drain, args=(receiving, self._inbox, number), name="turnopd-generator-drain",
                         daemon=True).start()
        return _Generator(number, process, requests)

    def _await_restart(self) -> None:
        """Handle the dead generator's last answers, then its end, which restarts it."""
        dead = self._generator.number
        self._wait(lambda: self._generator.number != dead)

    def _restart(self) -> None:
        """The generator died: start another (with a new weights lock, as the dead one may hold the
        old) and send it the requests left unanswered."""
        dead = self._generator.process
        dead.join(POLL_S)
        if dead.is_alive():  # its pipe closed, but it is still stuck somewhere
            dead.kill()
            dead.join()
        why = exit_reason(dead.exitcode)
        limit = self.cfg.pipeline.max_generator_restarts
        if self.restarts >= limit:
            raise GeneratorError(f"the generator process died ({why}); it was restarted {self.restarts} "
                                 f"times already (pipeline.max_generator_restarts={limit}). If it was killed "
                                 "for memory, lower env.num_workers or policy.max_batch_size")
        self.restarts += 1
        print(f"pipeline {self.mode}: the generator process died ({why}); restarting it ({self.restarts} of "
              f"{limit}) and sending its {len(self.pending)} unanswered requests again", file=sys.stderr)
        self.weights.lock = SPAWN.Lock()
        self._generator = self._start_generator(self._generator.number + 1)
        for request_id in sorted(self.pending):
            self._generator.requests.put(self.pending[request_id])


@contextmanager
def _open_generator(cfg: RunConfig, setup: Setup, *, trainer: Any, depth: DepthSchedule | EnvDepths, ledger: Ledger,
                    start_step: int, addons: Any = None, **_: Any) -> Iterator[GeneratorRollouts]:
    """Start the generator process with the trainer's current weights (version `start_step`); stop it on
    exit. A student's screenshots are freed between steps keeping what the generator's episodes hold
    (held_screens), and all of them once it has stopped."""
    with trainer.gathered_parameters() as module:
        weights = SharedWeights(module, version=start_step)
    rollouts = GeneratorRollouts(cfg, setup, weights, ledger, start_step=start_step,
                                 streams=env_streams(cfg, setup, depth, start_step))
    screens = addons.screens if addons is not None else None
    if screens is not None:
        screens.held = rollouts.held_screens
    try:
        yield rollouts
    finally:
        rollouts.close()
        if screens is not None:
            screens.held = None
            screens.free_between_steps()


PIPELINE_MODES.register("one_step_off")(PipelineMode(open=_open_generator, off_policy=True))
PIPELINE_MODES.register("pool")(PipelineMode(open=_open_generator, off_policy=True))
