"""Where each optimizer step's scored trajectories come from: recipe key `pipeline.mode`.

sync          the step's episodes are played and teacher-scored in the training process, with the
              step's own weights (the synchronous loop; the default).
one_step_off  a generator process plays and scores the batch of step k+1 while step k trains: the
              same tasks and seeds as sync, generated with weights one update old.
pool          an everlasting rollout pool: the generator process plays waves of episodes back to
              back (`pipeline.wave_episodes` each) and queues each scored wave; a step takes
              `trainer.episodes_per_step` trajectories, oldest first. One more than
              `pipeline.max_staleness` weight versions older than the trainer is dropped (and
              counted), never trained on; waves are requested only while their trajectories can be
              trained within that bound, so drops are rare. Newer weights are loaded between
              generation calls, also in the middle of a wave: the pool never stops for a sync.

A weight version is the number of optimizer steps behind the weights; a trajectory records the
version it started with (its oldest tokens). Stale tokens are corrected by the k1 importance ratio
exp(s_new - s_old), s_old being the log-prob stored when the token was sampled
(turnopd.objective.k1_loss, clipped by `objective.clip_eps`); the token-weight modes are the same
in every mode. Probes for the depth controller are always uncensored (full depth) and generated
with the newest weights: a probe request waits for the weights of its own step, and the new cap
applies to episodes started after the controller's update.

Processes: the generator is its own process (torch.multiprocessing, spawn) with its own policy,
teachers and env pool, and half of the CPU threads (the trainer keeps the rest). Weights travel
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
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import sys
import threading
import time
import traceback
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.multiprocessing as torch_mp
from torch import nn

from envs.base import EnvSpec
from envs.pool import EnvPool
from teachers import Teacher, make_teacher, score_trajectories
from turnopd.budget import DepthSchedule
from turnopd.config import EnvConfig, RunConfig
from turnopd.distributed import rank_and_world
from turnopd.ledger import Ledger
from turnopd.rollout import POLICY_BACKENDS, Generation, Policy, SamplingParams
from turnopd.rollout.engine import rollout
from turnopd.types import Trajectory

if TYPE_CHECKING:
    from turnopd.distill import Setup

# Task draws: salt 0 for a step's rollouts, 1 for its probes, POOL_SALT + start_step for pool waves
# (so that a resumed run does not replay the waves of the run it continues).
POOL_SALT = 2
JOIN_TIMEOUT_S = 60.0  # for the generator to finish its current request when the run ends
POLL_S = 1.0  # how often a process blocked on the other one checks that it is still alive
VERSION_POLL_S = 0.02  # how often a generator waiting for newer weights looks at their version
_CTX = torch_mp.get_context("spawn")


# ---- the episodes of a step -------------------------------------------------------------------


def sample_tasks(tasks: list[str], n: int, seed: int, step: int, salt: int) -> list[str]:
    """n training tasks for a step, a pure function of (seed, step, salt) so a resumed run draws
    the same tasks as an uninterrupted one (with replacement only when n exceeds the split)."""
    rng = np.random.default_rng([seed, step, salt])
    return [tasks[i] for i in rng.choice(len(tasks), size=n, replace=n > len(tasks))]


def step_sampling(cfg: RunConfig, step: int) -> SamplingParams:
    p = cfg.policy
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens,
                          stop=tuple(p.stop), n=1, seed=cfg.seed * 1_000_003 + step)


@dataclass(frozen=True)
class BatchPlan:
    """What optimizer step `step` trains on: probes (full depth, for the depth controller) or
    rollouts capped at `cap` turns."""

    step: int
    probe: bool
    cap: int


def plan_batch(depth: DepthSchedule, step: int, max_turns: int) -> BatchPlan:
    probe = depth.should_probe(step)
    return BatchPlan(step, probe, max_turns if probe else depth.cap_at(step))


@dataclass(frozen=True)
class Episodes:
    """Episodes to play: this rank's task ids (one episode each), their sampling, probes or not."""

    tasks: list[str]
    sampling: SamplingParams
    probe: bool


def step_episodes(cfg: RunConfig, train_tasks: list[str], plan: BatchPlan) -> Episodes:
    """This rank's share of step `plan.step`'s episodes: the same tasks and seeds in every mode."""
    rank, world = rank_and_world()
    n = cfg.depth.num_probes if plan.probe else cfg.trainer.episodes_per_step
    tasks = sample_tasks(train_tasks, n, cfg.seed, plan.step, salt=int(plan.probe))[rank::world]
    return Episodes(tasks, step_sampling(cfg, plan.step), plan.probe)


def wave_episodes(cfg: RunConfig, train_tasks: list[str], start_step: int, wave: int) -> Episodes:
    """This rank's share of pool wave `wave` of a run (re)started at `start_step`: tasks and
    sampling seed are pure functions of (seed, start_step, wave)."""
    rank, world = rank_and_world()
    salt = POOL_SALT + start_step
    n = cfg.pipeline.wave_episodes or cfg.trainer.episodes_per_step
    tasks = sample_tasks(train_tasks, n, cfg.seed, wave, salt)[rank::world]
    seed = int(np.random.default_rng([cfg.seed, wave, salt]).integers(2**31))
    return Episodes(tasks, dataclasses.replace(step_sampling(cfg, wave), seed=seed), probe=False)


def play_and_score(spec: EnvSpec, env_config: EnvConfig, pool: EnvPool, policy: Policy,
                   teachers: dict[str, Teacher], episodes: Episodes, cap: int,
                   ledger: Ledger) -> list[Trajectory]:
    """Play the episodes for at most `cap` turns and fill in the teachers' log-probs. Probes are
    timed as one "probe" phase; rollouts as rollout, env and teacher."""
    with ledger.phase("probe") if episodes.probe else nullcontext():
        trajectories = rollout(spec, pool, policy, episodes.tasks, env_config=env_config,
                               sampling=episodes.sampling, cap=cap, is_probe=episodes.probe, ledger=ledger)
        with ledger.phase("teacher"):
            score_trajectories(teachers, trajectories)
    return trajectories


# ---- the rollout sources the loop asks ---------------------------------------------------------


@dataclass
class PipelineStats:
    """A step's record of where its trajectories came from."""

    mode: str
    weight_version: int = 0  # the trainer's weights when the step trained (optimizer steps before it)
    staleness_max: int = 0  # versions the trained trajectories lag the trainer
    staleness_mean: float = 0.0
    dropped_stale: int = 0  # this step: older than pipeline.max_staleness, dropped untrained
    queued: int = 0  # after the step took its batch: generated and received, not trained yet
    generator_restarts: int = 0  # since the run (re)started


class Rollouts(Protocol):
    """Where the loop gets each step's scored trajectories.

    take(plan)                 the step's trajectories (this rank's share), teacher-scored
    prepare(plan)              the next step's plan, known once the depth controller has been updated
                               (asynchronous modes start generating it now)
    publish(weights, version)  new student weights after an optimizer step
    stats()                    PipelineStats of the batch `take` returned last
    """

    def take(self, plan: BatchPlan) -> list[Trajectory]: ...
    def prepare(self, plan: BatchPlan) -> None: ...
    def publish(self, weights: nn.Module, version: int) -> None: ...
    def stats(self) -> PipelineStats: ...


class InProcessRollouts:
    """sync: each step's episodes are played and scored in the training process when the step
    takes them, with the weights the loop has just given the policy."""

    def __init__(self, cfg: RunConfig, setup: Setup, pool: EnvPool, policy: Policy,
                 teachers: dict[str, Teacher], ledger: Ledger):
        self.cfg, self.setup, self.pool, self.policy = cfg, setup, pool, policy
        self.teachers, self.ledger = teachers, ledger
        self._stats = PipelineStats("sync")

    def take(self, plan: BatchPlan) -> list[Trajectory]:
        self._stats = PipelineStats("sync", weight_version=plan.step)
        return play_and_score(self.setup.spec, self.cfg.env, self.pool, self.policy, self.teachers,
                              step_episodes(self.cfg, self.setup.train_tasks, plan), plan.cap, self.ledger)

    def prepare(self, plan: BatchPlan) -> None:
        """Nothing starts early: the batch is played when its step takes it."""

    def publish(self, weights: nn.Module, version: int) -> None:
        """Nothing to send: the policy plays with the loop's own (updated) weights."""

    def stats(self) -> PipelineStats:
        return self._stats


@contextmanager
def open_rollouts(cfg: RunConfig, setup: Setup, *, trainer: Any, policy: Policy, pool: EnvPool,
                  teachers: dict[str, Teacher], depth: DepthSchedule, ledger: Ledger,
                  start_step: int) -> Iterator[Rollouts]:
    """The rollout source of `cfg.pipeline.mode`; an asynchronous one starts its generator process
    with the trainer's current weights (version `start_step`) and stops it on exit."""
    if cfg.pipeline.mode == "sync":
        yield InProcessRollouts(cfg, setup, pool, policy, teachers, ledger)
        return
    with trainer.gathered_parameters() as module:
        weights = SharedWeights(module, version=start_step)
    # The pool's queue is emptied by the steps that do not probe; should_probe depends on the step only.
    train_steps = [s for s in range(start_step, cfg.trainer.steps) if not depth.should_probe(s)]
    rollouts = GeneratorRollouts(cfg, setup, weights, ledger, start_step=start_step, train_steps=train_steps)
    try:
        yield rollouts
    finally:
        rollouts.close()


# ---- weights in shared memory ------------------------------------------------------------------


class PeerGone(Exception):
    """The process on the other side of the pipeline has died (or, for the generator, the run is over)."""


class SharedWeights:
    """The trainer's newest student weights in shared memory, with their version. The trainer
    writes them after each optimizer step; the generator copies them into its policy. Both copy
    under `lock`, so the generator never loads half of an update. The version and the other shared
    flags are plain shared integers, read and written without a lock: no process can die holding one."""

    def __init__(self, module: nn.Module, version: int):
        self.tensors = {name: t.detach().to("cpu", copy=True).share_memory_()
                        for name, t in module.state_dict().items()}
        self.dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
        self.version = _CTX.Value("q", version, lock=False)
        self.lock = _CTX.Lock()

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
        for name, tensor in module.state_dict().items():
            self.tensors[name].copy_(tensor.detach())
        self.version.value = version

    def wait_for(self, version: int, running: Callable[[], bool]) -> None:
        """(generator) Block until weights of at least `version` are published."""
        while self.version.value < version:
            if not running():
                raise PeerGone
            time.sleep(VERSION_POLL_S)

    def load_into(self, policy: Policy, trainer_alive: Callable[[], bool]) -> None:
        """(generator) Copy the newest weights into the policy, unless it has them already."""
        if self.version.value == policy.weight_version:
            return
        with self.locked(trainer_alive):
            version = self.version.value
            policy.update_weights(self.tensors)
        # The pipeline's version counts the trainer's optimizer steps, not the backend's reloads.
        policy.weight_version = version


class RefreshingPolicy:
    """A policy that loads newer published weights before each generation call (pool waves), so
    the pool never stops for a weight sync. Trajectories keep the version they started with."""

    def __init__(self, policy: Policy, weights: SharedWeights, trainer_alive: Callable[[], bool]):
        self.policy, self.weights, self.trainer_alive = policy, weights, trainer_alive
        self.tokenizer, self.max_model_len = policy.tokenizer, policy.max_model_len

    @property
    def weight_version(self) -> int:
        return self.policy.weight_version

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Generation]]:
        self.weights.load_into(self.policy, self.trainer_alive)
        return self.policy.generate(prompts, sampling)


# ---- the generator process ---------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """Play these episodes with weights at least `min_version` new. A pool `wave` loads newer
    weights between generation calls and feeds the queue; otherwise the answer is one step's batch."""

    id: int
    episodes: Episodes
    min_version: int
    wave: bool


@dataclass
class Produced:
    """A request's scored trajectories, and the generator's busy and idle seconds per phase since
    its previous answer."""

    request_id: int
    trajectories: list[Trajectory]
    phases: dict[str, float]


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


def _next_request(requests: Any, stop: Any, trainer: Any, ledger: Ledger) -> Request | None:
    """The next request, or None when the run is over (told to stop, or the trainer is gone)."""
    with ledger.phase("idle"):
        while True:
            try:
                request = requests.get(timeout=POLL_S)
                return None if stop.value else request
            except queue.Empty:
                if not trainer.is_alive():
                    return None


def _generator_main(cfg: RunConfig, setup: Setup, weights: SharedWeights, cap: Any, requests: Any,
                    results: Connection, stop: Any, threads: int) -> None:
    """The generator process: answers requests in order until the run is over."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process, which stops us
    torch.set_num_threads(threads)
    trainer = torch_mp.parent_process()
    ledger = Ledger()
    try:
        with ledger.phase("startup"):
            teachers = {env: make_teacher(spec) for env, spec in setup.teacher_specs.items()}
            policy = POLICY_BACKENDS.get(cfg.policy.backend)(str(setup.student_path), cfg.policy,
                                                             dtype=weights.dtype, seed=cfg.seed)
            policy.weight_version = -1  # the folder's weights, not yet the trainer's
            pool = EnvPool(setup.spec, cfg.env.num_workers, cfg.env.step_timeout_s)
        with pool:
            while (request := _next_request(requests, stop, trainer, ledger)) is not None:
                with ledger.phase("idle"):  # the run may end meanwhile (the trainer failed, or is gone)
                    weights.wait_for(request.min_version, lambda: trainer.is_alive() and not stop.value)
                with ledger.phase("weight_sync"):
                    weights.load_into(policy, trainer.is_alive)
                player = RefreshingPolicy(policy, weights, trainer.is_alive) if request.wave else policy
                turns = cfg.env.max_turns if request.episodes.probe else cap.value  # the cap when it starts
                trajectories = play_and_score(setup.spec, cfg.env, pool, player, teachers, request.episodes,
                                              turns, ledger)
                results.send(Produced(request.id, trajectories, ledger.end_step()))
    except (PeerGone, BrokenPipeError):
        return  # the run is over, or the training process is gone: nobody to answer
    except Exception:
        results.send(GeneratorFailed(traceback.format_exc()))


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


class GeneratorRollouts:
    """one_step_off and pool: batches played and scored by a generator process (module docstring)."""

    def __init__(self, cfg: RunConfig, setup: Setup, weights: SharedWeights, ledger: Ledger, *,
                 start_step: int, train_steps: Sequence[int]):
        self.cfg, self.setup, self.weights, self.ledger = cfg, setup, weights, ledger
        self.mode, self.start_step, self.train_steps = cfg.pipeline.mode, start_step, list(train_steps)
        rank, world = rank_and_world()
        self.batch = len(range(rank, cfg.trainer.episodes_per_step, world))  # this rank's share of a step
        self.cap = _CTX.Value("i", cfg.env.max_turns, lock=False)  # for episodes started from now on
        self.stop = _CTX.Value("b", False, lock=False)
        self.pending: dict[int, Request] = {}  # sent, not answered yet: sent again after a restart
        self.answers: dict[int, Produced] = {}  # answered step batches (and probes), not taken yet
        self.step_requests: dict[int, int] = {}  # step -> the request for its batch
        self.fifo: deque[Trajectory] = deque()  # pool: trajectories of answered waves, oldest first
        self.waves = 0  # pool: waves requested
        self.wave_requested = 0  # pool: their episodes, less the dropped ones
        self.restarts = 0
        self._next_id = 0
        self._stats = PipelineStats(self.mode)
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

    def take(self, plan: BatchPlan) -> list[Trajectory]:
        self._follow_cap(plan)
        version = self.weights.version.value
        dropped = 0
        if plan.probe or self.mode == "one_step_off":
            if plan.step not in self.step_requests:  # not prepared: the first step of a (resumed) run
                self._request_step(plan)
            request_id = self.step_requests.pop(plan.step)
            self._wait(lambda: request_id in self.answers)
            trajectories = self.answers.pop(request_id).trajectories
        else:
            trajectories = []
            while len(trajectories) < self.batch:
                self._top_up()
                self._wait(lambda: bool(self.fifo))
                taken, dropped_now = take_fresh(self.fifo, self.batch - len(trajectories), version,
                                                self.cfg.pipeline.max_staleness)
                trajectories += taken
                dropped += dropped_now
                self.wave_requested -= dropped_now  # their places in the step order go to later ones
        staleness = [version - t.weight_version for t in trajectories]
        self._stats = PipelineStats(
            self.mode, weight_version=version, staleness_max=max(staleness, default=0),
            staleness_mean=sum(staleness) / max(len(staleness), 1), dropped_stale=dropped,
            queued=len(self.fifo) + sum(len(a.trajectories) for a in self.answers.values()),
            generator_restarts=self.restarts)
        return trajectories

    def prepare(self, plan: BatchPlan) -> None:
        self._follow_cap(plan)
        if plan.probe or self.mode == "one_step_off":
            self._request_step(plan)
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

    def close(self) -> None:
        self.stop.value = True
        self._generator.requests.put(None)  # wakes a waiting generator
        self._generator.process.join(JOIN_TIMEOUT_S)
        if self._generator.process.is_alive():
            self._generator.process.kill()
            self._generator.process.join(JOIN_TIMEOUT_S)
        self._poll()
        untrained = len(self.fifo) + sum(len(a.trajectories) for a in self.answers.values())
        if untrained or self.pending:
            print(f"pipeline {self.mode}: run over with {untrained} trajectories generated and not trained, "
                  f"and {len(self.pending)} requests unanswered (dropped)", file=sys.stderr)
        torch.set_num_threads(self._threads_before)

    @property
    def generator_pid(self) -> int:
        return self._generator.process.pid

    # ---- requests and answers -----------------------------------------------------------------

    def _follow_cap(self, plan: BatchPlan) -> None:
        if not plan.probe:
            self.cap.value = plan.cap

    def _request_step(self, plan: BatchPlan) -> None:
        """The batch of one step: probes wait for the step's own weights, one_step_off rollouts
        for the previous step's (the newest when the request is made)."""
        episodes = step_episodes(self.cfg, self.setup.train_tasks, plan)
        min_version = plan.step if plan.probe else plan.step - 1
        self.step_requests[plan.step] = self._send(episodes, min_version, wave=False)

    def _top_up(self) -> None:
        """pool: request waves while they may be (see may_request_wave)."""
        if self.mode != "pool":
            return
        while True:
            episodes = wave_episodes(self.cfg, self.setup.train_tasks, self.start_step, self.waves)
            version, bound = self.weights.version.value, self.cfg.pipeline.max_staleness
            if not may_request_wave(self.wave_requested, len(episodes.tasks), self.batch, version, bound,
                                    self.train_steps):
                return
            self._send(episodes, min_version=0, wave=True)
            self.waves += 1
            self.wave_requested += len(episodes.tasks)

    def _send(self, episodes: Episodes, min_version: int, wave: bool) -> int:
        request = Request(self._next_id, episodes, min_version, wave)
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
        self.ledger.add_generator_phases(message.phases)
        request = self.pending.pop(message.request_id)
        if request.wave:
            self.fifo.extend(message.trajectories)
        else:
            self.answers[request.id] = message

    # ---- the process --------------------------------------------------------------------------

    def _start_generator(self, number: int) -> _Generator:
        receiving, sending = _CTX.Pipe(duplex=False)
        requests = _CTX.Queue()
        process = _CTX.Process(target=_generator_main, name=f"turnopd-generator-{number}", args=(
            self.cfg, self.setup, self.weights, self.cap, requests, sending, self.stop,
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
        self.weights.lock = _CTX.Lock()
        self._generator = self._start_generator(self._generator.number + 1)
        for request_id in sorted(self.pending):
            self._generator.requests.put(self.pending[request_id])

