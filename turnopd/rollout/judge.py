"""Judge before you run (recipe block `judge`; Rehearse's method, turnopd.algorithm.judge): at each turn
of a real episode the policy samples `k` candidate actions, a judge compares the distinct valid ones
pairwise in both orders (strict consensus), and the winner is the action the env runs. The
trajectory keeps the chosen candidate's tokens and log-probs, so OPD supervises the action that ran.

Judges (`judge.by`):
- teacher: the recipe's teacher prompted as a judge ("Change A ... Change B ... Answer A or B"); its
  pick is the answer its scores make more likely (equal scores: no pick);
- teacher_policy: the teacher's log-probability of each candidate as its own answer to the turn's
  agent prompt; the likelier one is the pick (order-free, like the world model's);
- world_model: the world model (`world_model.path`) predicts each candidate's metric (the mean of its
  `world_model.samples` answers' envs.base.MetricReader readings); the higher one is the pick (equal
  or unreadable: none). Its prediction does not depend on the order, so both orders always agree.

The outcome memory (`judge.memory`) holds every real attempt of the run: the attempts of earlier
steps (committed after each step, appended to the run's judge_memory.jsonl, kept through a resume)
and the playing episode's own earlier turns. Episodes of the same step never see each other's, so an
episode judges the same whatever it is batched with. An attempt is a turn whose next observation
reports a metric (its change against the best included); the others (invalid actions, a submit) are
not experiments.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.base import EnvSpec, MetricReader, PromptContext, format_answer, recent_pairs
from turnopd.algorithm.judge import JUDGES, Attempt, Decision, Tournament, memory_lines, round_robin
from turnopd.core.distributed import gather_objects, rank_and_world
from turnopd.core.types import Trajectory
from turnopd.rollout.agent_loop import POLICY_SAMPLE, Busy, TurnState
from turnopd.rollout.base import Generation, Policy, SamplingParams, request_seed
from turnopd.rollout.render import RenderedPrompt, chat_prompt_ids
from turnopd.rollout.world_model_pool import trace_of

MEMORY_FILE = "judge_memory.jsonl"
CANDIDATE_STREAM = 1  # the 4th key of a candidate's sampling stream (candidate 0 keeps the turn's own stream)


def attempts_of(spec: EnvSpec, task_id: str, steps: Sequence[tuple[str, str]], order: Callable[[int], tuple[int, ...]]
                ) -> list[Attempt]:
    """The attempts in an episode's `steps`, each (action played, observation the env answered), step i
    ordered order(i): those whose answer reports a metric with its change (envs.base.MetricReader)."""
    out = []
    for i, (action, answer) in enumerate(steps):
        reading = spec.read_metric(answer)
        if reading is not None and reading.change is not None:
            out.append(Attempt(task_id, action, reading.metric - reading.change, reading.metric, reading.helps, order(i)))
    return out


def episode_steps(history: Sequence[tuple[str, str]], observation: str) -> list[tuple[str, str]]:
    """(action, the observation that answered it) pairs from an episode's (observation seen, action)
    history and its current observation."""
    answers = [obs for obs, _ in history[1:]] + [observation] if history else []
    return [(action, answer) for (_, action), answer in zip(history, answers, strict=True)]


def trajectory_attempts(spec: EnvSpec, trajectory: Trajectory, step: int) -> list[Attempt]:
    """A played episode's attempts, ordered (step, turn index)."""
    history = [(t.observation, spec.parse_action(t.action_text).action) for t in trajectory.turns]
    turns = [t.index for t in trajectory.turns]
    return attempts_of(spec, trajectory.task_id, episode_steps(history, trajectory.final_observation),
                       lambda i: (step, turns[i]))


def json_lines(attempts: Sequence[Attempt]) -> str:
    return "".join(json.dumps(a.to_json()) + "\n" for a in attempts)


class OutcomeMemory:
    """The run's committed attempts, appended to `path` (a JSON-lines file, flushed and fsynced per
    step; None: in memory) by the `writer` (rank 0; the other ranks read it). Opening it for a run
    resumed at `start_step` keeps the attempts of the steps before it (a killed run's later ones are
    played again)."""

    def __init__(self, path: Path | None = None, start_step: int = 0, writer: bool = True):
        self.path, self.writer = path, writer
        self.attempts: list[Attempt] = []
        if path is not None and path.is_file():
            kept = [a for line in path.read_text().splitlines() if line.strip()
                    for a in [Attempt.from_json(json.loads(line))] if a.order[0] < start_step]
            self.attempts = kept
            if not writer:
                return
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json_lines(kept))
            os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one

    def commit(self, attempts: Sequence[Attempt]) -> None:
        self.attempts.extend(attempts)
        if self.path is not None and attempts and self.writer:
            with self.path.open("a") as f:
                f.write(json_lines(attempts))
                f.flush()
                os.fsync(f.fileno())


JUDGE_PROMPT = ("You are an expert machine-learning researcher. Before running an experiment, judge which of two "
                "proposed changes is more likely to improve the result.")


def judge_prompt(goal: str, observation: str, memory: Sequence[str], first: str, second: str) -> str:
    """The teacher judge's prompt: the goal, the current state, the memory lines, the two changes."""
    lines = [JUDGE_PROMPT, f"Task: {goal}", f"Current state: {observation}"]
    if memory:
        lines += ["Earlier attempts on this task:", *(f"- {line}" for line in memory)]
    lines += [f"Change A: {first}", f"Change B: {second}",
              "Which change is more likely to improve the result? Answer A or B."]
    return "\n".join(lines)


class TeacherJudge:
    """The teacher as a judge: shown (x, y) it picks x when log p(A) > log p(B) after the judge prompt."""

    def __init__(self, teacher: Any):
        self.teacher = teacher
        tokenizer = teacher.tokenizer
        self.answers = [tokenizer.encode(a, add_special_tokens=False) for a in ("A", "B")]
        self.calls = 0  # teacher sequences scored

    async def picks(self, decision: Decision, candidates: Sequence[str], memory: Sequence[str]
                    ) -> dict[tuple[int, int], int | None]:
        orders = [(x, y) for x in range(len(candidates)) for y in range(len(candidates)) if x != y]
        sequences = []
        for x, y in orders:
            prompt = chat_prompt_ids(self.teacher.tokenizer, judge_prompt(
                decision.goal, decision.observation, memory, candidates[x], candidates[y]))
            sequences += [prompt + answer for answer in self.answers]
        scores = await asyncio.to_thread(self.teacher.score, sequences)
        self.calls += len(sequences)
        out = {}
        for n, (x, y) in enumerate(orders):
            a, b = (sum(s.logprobs[-len(answer):]) for s, answer in zip(scores[2 * n:2 * n + 2], self.answers,
                                                                         strict=True))
            out[(x, y)] = x if a > b else y if b > a else None
        return out


class TeacherPolicyJudge:
    """The teacher's own policy as a judge: each candidate's log-probability as the teacher's answer
    (envs.base.format_answer) to the turn's agent prompt, the prompt it scores in OPD (rendered from the
    decision: the env's template with `history_length` pairs; no admissible list); shown (x, y) it picks
    the likelier. Its scores do not depend on the order. It reads no memory (the agent prompt has no
    place for it)."""

    def __init__(self, teacher: Any, spec: EnvSpec, history_length: int, answer_format: str):
        self.teacher, self.spec = teacher, spec
        self.history_length, self.answer_format = history_length, answer_format
        self.calls = 0  # teacher sequences scored

    async def picks(self, decision: Decision, candidates: Sequence[str], memory: Sequence[str]
                    ) -> dict[tuple[int, int], int | None]:
        tokenizer = self.teacher.tokenizer
        prompt = chat_prompt_ids(tokenizer, self.spec.render_prompt(PromptContext(
            task=decision.goal, step=len(decision.history), observation=decision.observation,
            history=recent_pairs(decision.history, self.history_length), answer_format=self.answer_format)))
        answers = [tokenizer.encode(format_answer(c, self.answer_format), add_special_tokens=False) for c in candidates]
        scores = await asyncio.to_thread(self.teacher.score, [prompt + a for a in answers])
        self.calls += len(answers)
        return order_free_picks([sum(s.logprobs[-len(a):]) for s, a in zip(scores, answers, strict=True)])


def order_free_picks(values: Sequence[float | None]) -> dict[tuple[int, int], int | None]:
    """The picks of a judge that scores each candidate alone: shown (x, y), the higher score's
    candidate; none when they are equal or either is missing."""
    return {(x, y): None if vx is None or vy is None or vx == vy else x if vx > vy else y
            for x, vx in enumerate(values) for y, vy in enumerate(values) if x != y}


class WorldModelJudge:
    """The world model as a judge: each candidate's predicted metric; shown (x, y) it picks the higher."""

    def __init__(self, world: Any):
        self.world = world
        self.calls = 0  # candidates predicted

    async def picks(self, decision: Decision, candidates: Sequence[str], memory: Sequence[str]
                    ) -> dict[tuple[int, int], int | None]:
        metrics = await asyncio.gather(*(self.world.predict_metric(
            decision.goal, decision.first_observation, decision.history, decision.observation, c,
            keys=(decision.episode, decision.order[1], i)) for i, c in enumerate(candidates)))
        self.calls += len(candidates)
        return order_free_picks(metrics)


@dataclass
class JudgeStats:
    """Counts over the turns a judge decided: `turns` with two or more distinct valid candidates,
    `pairs` asked, `verdicts` (pairs both orders agreed on), `overrides` (turns whose winner was not
    the policy's first sample)."""

    turns: int = 0
    pairs: int = 0
    verdicts: int = 0
    overrides: int = 0

    def add(self, tournament: Tournament, chosen_is_first: bool) -> None:
        self.turns += 1
        self.pairs += tournament.pairs
        self.verdicts += tournament.verdicts
        self.overrides += not chosen_is_first


class Judge:
    """A recipe's `judge` block at work: `select` returns the generation to play at a turn."""

    def __init__(self, spec: EnvSpec, by: Any, *, k: int, temperature: float, memory: str, threshold: float,
                 limit: int, outcomes: OutcomeMemory):
        self.spec, self.by, self.k, self.temperature, self.memory = spec, by, k, temperature, memory
        self.threshold, self.limit, self.outcomes = threshold, limit, outcomes
        self.step = 0  # the step being played (start_batch): the first key of the memory's order
        self.stats = JudgeStats()

    def start_batch(self, step: int) -> None:
        self.step, self.stats = step, JudgeStats()

    def commit(self, trajectories: Sequence[Trajectory]) -> None:
        """After a step: its real episodes' attempts, every rank's, join every rank's memory (simulated
        ones are the model's); rank 0 writes them. An env that reports no metric has no attempts to
        remember (its judge runs without memory: the recipe check refuses one with)."""
        if not isinstance(self.spec, MetricReader):
            return
        local = [a for t in trajectories if not trace_of(t).played for a in trajectory_attempts(self.spec, t, self.step)]
        self.outcomes.commit([a for part in gather_objects(local) for a in part])

    async def act(self, policy: Policy, prompt: RenderedPrompt, sampling: SamplingParams, state: TurnState,
                  busy: Busy) -> Generation:
        """The agent loop's action source (turnopd.rollout.agent_loop.ActionSource): the turn's own sample,
        then in a real episode the judge's pick among k candidates (a world model's step costs no real
        run to save)."""
        first = await POLICY_SAMPLE.act(policy, prompt, sampling, state, busy)
        if state.reset_info.get("world_model"):  # WorldModelPool's reset marks the episodes it plays
            return first
        return await self.select(policy, prompt.ids, sampling, first, busy, Decision(
            state.task_id, state.episode, state.goal, state.first_observation, state.history, state.observation,
            (self.step, state.turn)))

    async def select(self, policy: Policy, prompt: list[int], sampling: SamplingParams, first: Generation,
                     busy: Callable[[str], AbstractContextManager[Any]], decision: Decision) -> Generation:
        """The generation to play: `first` (the turn's own sample) or one of k - 1 more, sampled at the
        judge's temperature from their own streams (in busy("generation")), as the judge decides (in
        busy("judge")) among the distinct valid actions."""
        with busy("generation"):
            more = await asyncio.gather(*(policy.generate(prompt, dataclasses.replace(
                sampling, temperature=self.temperature, top_p=1.0,
                seed=request_seed(sampling.seed, decision.episode, decision.order[1], CANDIDATE_STREAM, c)))
                for c in range(1, self.k)))
        generations = [first, *more]
        actions: dict[str, int] = {}  # distinct valid action -> its first generation
        for i, g in enumerate(generations):
            parsed = self.spec.parse_action(g.text)
            if parsed.valid:
                actions.setdefault(parsed.action, i)
        if len(actions) < 2:
            return first
        candidates = list(actions)
        lines = self._memory_lines(decision, candidates)
        with busy("judge"):
            picks = await self.by.picks(decision, candidates, lines)
        tournament = round_robin(len(candidates), lambda x, y: picks[(x, y)])
        # no verdict at all: the policy's own sample, even an invalid one (only a verdict overrides it)
        chosen = actions[candidates[tournament.chosen]] if tournament.verdicts else 0
        self.stats.add(tournament, chosen == 0)
        return generations[chosen]

    def _memory_lines(self, decision: Decision, candidates: list[str]) -> list[str]:
        """The memory the judge reads at this turn: the committed attempts and the episode's own earlier
        turns (read from its history only when a memory is on)."""
        if self.memory == "none":
            return []
        own = attempts_of(self.spec, decision.task_id, episode_steps(decision.history, decision.observation),
                          lambda i: (self.step, i))
        return memory_lines(self.memory, [*self.outcomes.attempts, *own], decision.task_id,
                            (self.step, decision.order[1]), candidates, self.threshold, self.limit)


def make_judge(by: str, cfg: Any, spec: EnvSpec, teacher: Any, world: Any) -> Any:
    """The judge `by` names (judge.by), over the env's teacher or the world-model pool."""
    if by == "teacher":
        return TeacherJudge(teacher)
    if by == "teacher_policy":
        return TeacherPolicyJudge(teacher, spec, cfg.env.history_length, cfg.env.answer_format)
    if by == "world_model":
        return WorldModelJudge(world)
    raise ValueError(f"judge.by must be one of {', '.join(JUDGES)}, got {by!r}")


def open_judge(cfg: Any, spec: EnvSpec, teachers: dict[str, Any], world: Any, run_dir: Path | None,
               start_step: int = 0) -> Judge | None:
    """The Judge a recipe's `judge` block asks for (None for judge.by: none), its memory kept in
    run_dir/judge_memory.jsonl (resumed at `start_step`)."""
    j = cfg.judge
    if j.by == "none":
        return None
    by = make_judge(j.by, cfg, spec, teachers.get(cfg.env.name), world)
    memory = OutcomeMemory(run_dir / MEMORY_FILE if run_dir is not None else None, start_step,
                           writer=rank_and_world()[0] == 0)
    return Judge(spec, by, k=j.k, temperature=j.temperature, memory=j.memory, threshold=j.similarity_threshold,
                 limit=j.memory_limit, outcomes=memory)
