"""World-model rollouts: a model built by `turnopd world-model train` answers an episode's env steps:
a language model that samples its answers, or a WorldAnswerer its env computes them with
(autoresearch's job model, envs.autoresearch.job_model); `load_world_model` opens either.

`WorldModelPool` has the env pool's episode interface (`reset_slot`, `step_slot`, `end`), so the
rollout engine plays an episode in it as in the real env; `WorldModelPool.runner` is the episode
runner (`rollout(..., run_episode=...)`) that plays the episodes it is told to in the model and has
the model judge the others. What the model did in an episode is the episode's WorldModelTrace
(`trace_of`). A reset is the real env's: the first observation (in ALFWorld the room
and its receptacles) is the task's, not something to invent, and a costly env's reset is paid once
per task, then cached. Each step renders envs.transitions' prompt from the episode so far and
samples `samples` answers (status line and observation) from the world model; the first is played,
and their disagreement d = 1 - (count of the modal answer) / K goes into the episode's trace, from
which the trajectory is weighted (Inverse-Variance Denoising, turnopd.algorithm.world_model_corrections). An answer without a status line ends the episode as
failed-by-env ("the world model answered without a status line"), and so does one whose
observation the env's prompt template refuses (ALFWorld's notebook template needs its notebook
line), or whose prompt and answer would not fit the model's context.

The model's verdict on a real episode, paired with the real outcome, measures the model's bias for
Online Debiasing. By default ("last_turn", `predict_success`) it is the share of K sampled answers
to the real last transition that say "won" (one step's error, at one model step, after the
episode). "replay" (a `Shadow`) has the model play the real episode's actions from its first
observation, each after its own previous answers, alongside the real episode; the verdict is its
ending, so the bias includes how the model's own histories drift under the real actions. Neither
sees the drift of a closed loop, where the student's actions answer the model's observations (on
ALFWorld the model's episodes end sooner and are won more often than real ones, and both verdicts
measured a bias near 0; docs/results/2026-12-03-world-models.md). "twin" (a `Shadow` too) does: beside the
real episode the student plays a twin episode of the same task in the model, from the real reset
and with the real episode's sampling streams, and the verdict is the twin's ending, so the bias
(twin - real) is the model episodes' own, closed loop included, at one model episode per real one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from envs.base import EnvSpec, PromptContext, StepOutcome, WorldAnswerer, recent_pairs
from envs.pool import env_error
from envs.transitions import parse_world_answer, world_prompt
from turnopd.algorithm.world_model_corrections import sample_disagreement
from turnopd.config import PolicyConfig
from turnopd.core.types import EpisodeSummary, Trajectory
from turnopd.rollout.agent_loop import Busy, EpisodeRunner
from turnopd.rollout.base import Policy, SamplingParams, make_policy, request_seed
from turnopd.rollout.render import chat_prompt_ids

WORLD_MODEL_META = "world_model.json"
ANSWERER_KIND = "answerer"  # world_model.json "kind" of a model an env computes answers with (EnvSpec.world_answerer)
VERDICTS = ("last_turn", "replay", "twin")  # world_model.verdict: how the model judges a real episode
REPLAY_STREAM = 2**32 - 1  # a replay's third sampling key: apart from the verdict's 0 and model episodes' 1, 2, ...
JUDGE_STREAM = 2**32 - 2  # a judge's prediction's third key (turnopd.rollout.judge)
NO_STATUS = "the world model answered without a status line"
UNRENDERABLE = "the world model's observation does not fit the env's prompt template"
TOO_LONG = "the world model's prompt does not fit its context (train it with a shorter history_length)"


def load_world_model_meta(path: str | Path, env_name: str) -> dict[str, Any]:
    """world_model.json of a world-model folder, checked to be of env `env_name` (ValueError naming
    what is wrong otherwise)."""
    meta_path = Path(path).expanduser() / WORLD_MODEL_META
    if not meta_path.is_file():
        raise ValueError(f"{meta_path} not found: name a folder written by `turnopd world-model train` "
                         f"(for {env_name}: turnopd world-model train recipes/{env_name}/world_model.yaml)")
    meta = json.loads(meta_path.read_text())
    if meta.get("env") != env_name:
        raise ValueError(f"the world model in {path} models env {meta.get('env')!r}, not env.name={env_name!r}")
    return meta


WORLD_MODEL = "world_model"  # this add-on's key in Trajectory.addons and EpisodeSummary.addons


@dataclass
class WorldModelTrace:
    """What the world model did in an episode: it answered its steps (`played`; per model step the
    disagreement of its sampled answers), or, for a real episode, its verdict P(won) (Online
    Debiasing; None: no usable answer) and the model steps that verdict took."""

    played: bool = False
    disagreements: list[float] = field(default_factory=list)
    predicted_success: float | None = None
    verdict_steps: int = 0


NO_TRACE = WorldModelTrace()


def trace_of(episode: Trajectory | EpisodeSummary) -> WorldModelTrace:
    """The episode's world-model trace (an empty one when the model took no part in it)."""
    return episode.addons.get(WORLD_MODEL, NO_TRACE)


@dataclass
class _Episode:
    goal: str
    first_observation: str
    observation: str
    history: list[tuple[str, str]] = field(default_factory=list)
    resets: int = 0


class Verdict(NamedTuple):
    success: float | None  # the model's P(won) for a real episode; None: it gave no usable answer
    steps: int  # the model steps it took


class WorldModelPool:
    ledger_resource = "world_model"  # the ledger busy time of its steps (the real env's is "env")

    def __init__(self, spec: EnvSpec, real: Any, model: Policy | WorldAnswerer, *, history_length: int,
                 max_observation_tokens: int, samples: int = 1, temperature: float = 1.0, seed: int = 0,
                 verdict: str = "last_turn"):
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {verdict!r}")
        self.spec, self.real, self.model = spec, real, model
        self.history_length, self.samples, self.verdict = history_length, samples, verdict
        self.sampling = SamplingParams(temperature=temperature, max_new_tokens=max_observation_tokens, stop=(),
                                       seed=seed)
        self._resets: dict[str, StepOutcome] = {}  # task id -> its real reset
        self._episodes: dict[int, _Episode] = {}
        self._traces: dict[int, WorldModelTrace] = {}  # per slot: its model episode's, since its reset
        self._batch = 0  # the batch being played (start_batch): the first key of every sampling stream
        self._reset_counts: dict[int, int] = {}  # per slot: its episodes in this batch (the second key)
        self.model_steps = 0  # steps the world model answered, over the pool's life
        self.real_resets = 0  # resets it asked the real env for (the others were cached)

    def start_batch(self, batch: int) -> None:
        """The next episodes are batch `batch`'s (the optimizer step's): each model answer is sampled
        from the stream (seed, batch, slot, episode in the slot, step, sample), so a resumed run
        samples what an uninterrupted one would have."""
        self._batch, self._reset_counts = batch, {}

    async def reset_slot(self, slot: int, task_id: str) -> StepOutcome:
        outcome = self._resets.get(task_id)
        if outcome is None:
            outcome = await self.real.reset_slot(slot, task_id)
            if outcome.done:  # the env failed: nothing to cache, the episode ends here
                return outcome
            self.real.end([slot])
            self._resets[task_id] = outcome
            self.real_resets += 1
        self._reset_counts[slot] = self._reset_counts.get(slot, 0) + 1
        self._episodes[slot] = _Episode(outcome.info.get("task", ""), outcome.observation, outcome.observation,
                                        resets=self._reset_counts[slot])
        self._traces[slot] = WorldModelTrace(played=True)
        return replace(outcome, info={**outcome.info, "world_model": True})

    async def step_slot(self, slot: int, action: str) -> StepOutcome:
        episode = self._episodes.get(slot)
        if episode is None:
            raise ValueError(f"slot {slot} has no episode playing (its episode has ended, or none started)")
        step = len(episode.history)
        answers = await self._sample(
            world_prompt(episode.goal, episode.first_observation, recent_pairs(episode.history, self.history_length),
                         step, episode.observation, action),
            (self._batch, slot, episode.resets, step))
        if answers is None:
            self._episodes.pop(slot)
            return env_error(TOO_LONG)
        self.model_steps += 1
        parsed = [parse_world_answer(a) for a in answers]
        if parsed[0] is None:
            self._episodes.pop(slot)
            return env_error(NO_STATUS)
        status, observation = parsed[0]
        episode.history.append((episode.observation, action))
        try:  # an observation the env's own prompt template refuses (e.g. ALFWorld's without its notebook line)
            self.spec.render_prompt(PromptContext(task=episode.goal, step=len(episode.history), observation=observation,
                                                  history=episode.history[-1:]))
        except ValueError as exc:
            self._episodes.pop(slot)
            return env_error(f"{UNRENDERABLE}: {exc}")
        episode.observation = observation
        done = status != "continue"
        if done:
            self._episodes.pop(slot)
        self._traces[slot].disagreements.append(disagreement(parsed))
        return StepOutcome(observation, reward=float(status == "won"), done=done, won=status == "won")

    def end(self, slots: list[int]) -> None:
        for slot in slots:
            self._episodes.pop(slot, None)

    def runner(self, real: Any, simulated: Sequence[bool], busy: Busy = lambda _: nullcontext()) -> EpisodeRunner:
        """The episode runner of a batch: episode i plays in this model when simulated[i]; each other
        one (every one for an empty `simulated`) plays the real pool `real` and gets the model's verdict on it (by self.verdict: the model's
        answer to its last transition, its replay in the model alongside it, or the ending of a twin
        episode of its task played in the model beside it, not trained on)."""

        async def run(i: int, episode: Callable[[Any], Awaitable[Trajectory]]) -> Trajectory:
            if simulated and simulated[i]:
                trajectory = await episode(self)
                trace = self.take_trace(i)  # None: the real reset failed, the model never played
                if trace is not None:
                    trajectory.addons[WORLD_MODEL] = trace
                return trajectory
            # "twin": the same task in the model, played beside it with its sampling streams (a closed loop)
            shadow = self.shadow(real, slot=i, busy=busy, twin=lambda: episode(self)) \
                if self.verdict != "last_turn" else None
            try:
                trajectory = await episode(shadow or real)
                if not trajectory.env_error:
                    if shadow is None:
                        with busy(self.ledger_resource):
                            verdict = await self.predict_success(trajectory, slot=i)
                    else:  # its model steps are in the world model's busy time already
                        verdict = await shadow.verdict()
                    trajectory.addons[WORLD_MODEL] = WorldModelTrace(predicted_success=verdict.success,
                                                                     verdict_steps=verdict.steps)
            finally:
                if shadow is not None:
                    shadow.cancel()  # a no-op once its verdict is in
                self.take_trace(i)  # a twin's
            return trajectory

        return run

    def take_trace(self, slot: int) -> WorldModelTrace | None:
        """The trace of the model episode last played in `slot` (None: none since the last take)."""
        return self._traces.pop(slot, None)

    async def predict_success(self, trajectory: Trajectory, slot: int) -> Verdict:
        """The "last_turn" verdict on a real episode: the share of `samples` answers to its real last
        transition that say "won" (0 at no model step for an episode with no turns; None when the
        prompt does not fit the model's context). The "replay" verdict is a `Shadow`'s."""
        if not trajectory.turns:
            return Verdict(0.0, 0)
        actions = [self.spec.parse_action(turn.action_text).action for turn in trajectory.turns]
        history = [(turn.observation, a) for turn, a in zip(trajectory.turns, actions, strict=True)][:-1]
        step = len(history)
        answers = await self._sample(
            world_prompt(trajectory.goal, trajectory.turns[0].observation, recent_pairs(history, self.history_length),
                         step, trajectory.turns[-1].observation, actions[-1]),
            (self._batch, slot, 0, step))
        if answers is None:
            return Verdict(None, 0)
        return Verdict(sum((p := parse_world_answer(a)) is not None and p[0] == "won" for a in answers) / len(answers), 1)

    async def predict_metric(self, goal: str, first_observation: str, history: Sequence[tuple[str, str]],
                             observation: str, action: str, keys: tuple[int, ...]) -> float | None:
        """The metric the model predicts `action` reaches after `history` and `observation` (the judge
        of turnopd.rollout.judge): the mean of its `samples` answers' readings (spec.read_metric),
        sampled from the stream (seed, batch, *keys[:1], JUDGE_STREAM, *keys[1:]); None when no answer
        reports one, or the prompt does not fit the model's context."""
        answers = await self._sample(
            world_prompt(goal, first_observation, recent_pairs(history, self.history_length), len(history),
                         observation, action), (self._batch, *keys[:1], JUDGE_STREAM, *keys[1:]))
        readings = [r for a in answers or [] if (p := parse_world_answer(a)) is not None
                    and (r := self.spec.read_metric(p[1])) is not None]
        return sum(r.metric for r in readings) / len(readings) if readings else None

    def shadow(self, real: Any, slot: int, busy: Callable[[str], Any] = lambda _: nullcontext(),
               twin: Callable[[], Awaitable[Trajectory]] | None = None) -> Shadow:
        """A stand-in for the real env pool `real` for one real episode in `slot` that judges it while
        it plays: "replay" replays its actions in the model; "twin" awaits `twin()`, the student's
        episode of the same task in this pool (slot `slot`, free here since its episode is real), once
        the real reset, cached for it, is in."""
        if self.verdict == "replay":
            return Shadow(real, lambda _task, outcome, actions: self.replay(
                outcome.info.get("task", ""), outcome.observation, actions, slot, busy))
        if self.verdict == "twin" and twin is not None:
            return Shadow(real, lambda task, outcome, _actions: self._twin(task, outcome, twin))
        raise ValueError(f"a shadow judges by replay or by twin (with the twin's episode), not by {self.verdict!r}")

    async def _twin(self, task_id: str, reset: StepOutcome, twin: Callable[[], Awaitable[Trajectory]]) -> Verdict:
        """The twin's ending: 1 when it won, 0 when it lost or stopped playing (cap or turn limit), None
        when the model gave an unusable answer; its steps are the model's."""
        self._resets[task_id] = reset
        played = await twin()
        return Verdict(None if played.env_error else float(played.success), played.depth)

    async def replay(self, goal: str, first_observation: str, actions: AsyncIterable[str], slot: int,
                     busy: Callable[[str], Any] = lambda _: nullcontext()) -> Verdict:
        """The model's ending of `actions` played in turn from `first_observation`, each after its own
        answers to the ones before, one sample a step (stream (seed, batch, slot, REPLAY_STREAM, step);
        each step inside busy("world_model")): 1 when its first ending says "won", 0 when it says
        "lost" or the actions run out first; None when an answer has no status line or does not fit
        the model's context."""
        observation, history = first_observation, []
        async for action in actions:
            step = len(history)
            with busy(self.ledger_resource):
                answers = await self._sample(
                    world_prompt(goal, first_observation, recent_pairs(history, self.history_length), step,
                                 observation, action), (self._batch, slot, REPLAY_STREAM, step), samples=1)
            if answers is None:
                return Verdict(None, step)
            parsed = parse_world_answer(answers[0])
            if parsed is None:
                return Verdict(None, step + 1)
            status, next_observation = parsed
            if status != "continue":
                return Verdict(float(status == "won"), step + 1)
            history.append((observation, action))
            observation = next_observation
        return Verdict(0.0, len(history))

    async def _sample(self, prompt: str, keys: tuple[int, ...], samples: int | None = None) -> list[str] | None:
        """`samples` (default the pool's) answers to the prompt; None when prompt and answer do not fit
        the model's context."""
        seeds = [request_seed(self.sampling.seed, *keys, k) for k in range(samples or self.samples)]
        if isinstance(self.model, WorldAnswerer):
            return self.model.answers(prompt, seeds, self.sampling.temperature)
        ids = chat_prompt_ids(self.model.tokenizer, prompt)
        if len(ids) + self.sampling.max_new_tokens > self.model.max_model_len:
            return None
        generations = await asyncio.gather(*(self.model.generate(ids, replace(self.sampling, seed=seed))
                                             for seed in seeds))
        return [g.text for g in generations]


class Shadow:
    """The real env pool for one real episode, with the world model judging it alongside (world_model.verdict
    replay or twin): the real reset starts `start(task_id, reset outcome, actions)`, where `actions`
    yields each action sent to the env as it is sent, and `verdict()` (after the episode) is what
    that returns. The model answers while the env does, so a costly env's waits hide its time; a
    replay's verdict is the one a replay of the finished episode's actions would give."""

    ledger_resource = "env"  # its steps are the real env's

    def __init__(self, real: Any, start: Callable[[str, StepOutcome, AsyncIterator[str]], Awaitable[Verdict]]):
        self.real, self.start = real, start
        self._actions: asyncio.Queue[str | None] = asyncio.Queue()
        self._judge: asyncio.Task[Verdict] | None = None

    async def reset_slot(self, slot: int, task_id: str) -> StepOutcome:
        outcome = await self.real.reset_slot(slot, task_id)
        if not outcome.done:
            self._judge = asyncio.create_task(self.start(task_id, outcome, self._queued()))
        return outcome

    async def step_slot(self, slot: int, action: str) -> StepOutcome:
        self._actions.put_nowait(action)
        return await self.real.step_slot(slot, action)

    def end(self, slots: list[int]) -> None:
        self.real.end(slots)

    async def verdict(self) -> Verdict:
        """The judgement once it has every action of the episode (0 at no step without a reset)."""
        if self._judge is None:
            return Verdict(0.0, 0)
        self._actions.put_nowait(None)
        return await self._judge

    def cancel(self) -> None:
        """Stop judging (its episode failed before a verdict was asked)."""
        if self._judge is not None:
            self._judge.cancel()

    async def _queued(self) -> AsyncIterator[str]:
        while (action := await self._actions.get()) is not None:
            yield action


async def listed(actions: list[str]) -> AsyncIterator[str]:
    """A list's actions as `WorldModelPool.replay` takes them (a finished episode's)."""
    for action in actions:
        yield action


def disagreement(parsed: list[tuple[str, str] | None]) -> float:
    """1 - (count of the most frequent answer) / K over K parsed answers (a missing status counts as
    an answer of its own)."""
    return sample_disagreement([p if p is None else (p[0], " ".join(p[1].split())) for p in parsed])


def load_world_model(path: str, spec: EnvSpec, env_name: str, generation: PolicyConfig,
                     seed: int) -> tuple[Policy | WorldAnswerer, dict[str, Any]]:
    """The world model in `path` and its world_model.json: a language model generating with
    `generation`'s backend (its max_new_tokens the model's max_observation_tokens), or, for a folder of
    kind ANSWERER_KIND, the answerer its env builds from it (spec.world_answerer)."""
    meta = load_world_model_meta(path, env_name)
    folder = Path(path).expanduser()
    if meta.get("kind") == ANSWERER_KIND:
        return spec.world_answerer(folder), meta
    generation = replace(generation, max_new_tokens=meta["max_observation_tokens"], stop=[])
    return make_policy(generation, str(folder), dtype="float32", seed=seed), meta


@contextmanager
def open_world_model(cfg: Any, spec: EnvSpec, real: Any) -> Iterator[WorldModelPool | None]:
    """The WorldModelPool a distillation recipe's `world_model` block asks for (None without a path),
    generating with the recipe's policy backend; its model is closed on exit."""
    wm = cfg.world_model
    if wm.path is None:
        yield None
        return
    generation = PolicyConfig(backend=cfg.policy.backend, temperature=wm.temperature,
                              max_batch_size=cfg.policy.max_batch_size * wm.samples, options=cfg.policy.options)
    model, meta = load_world_model(wm.path, spec, cfg.env.name, generation, cfg.seed)
    try:
        yield WorldModelPool(spec, real, model, history_length=meta["history_length"],
                             max_observation_tokens=meta["max_observation_tokens"], samples=wm.samples,
                             temperature=wm.temperature, seed=cfg.seed, verdict=wm.verdict)
    finally:
        if not isinstance(model, WorldAnswerer):
            model.close()
