"""Judge before you run (Rehearse, arXiv 2607.27687): pairwise strict-consensus votes among K candidate
actions, and the focused outcome memory the judge reads. Pure functions on small records; the judges
themselves (a world model's predicted metric, the teacher prompted as a judge) are
turnopd.rollout.judge's.

Strict consensus: a pair (i, j) is asked in both orders; it is a vote for a candidate only when both
orders pick it, and an abstention otherwise. The candidate with the most votes runs; with no vote at
all (or a tie) the earliest of the tied runs, so an abstaining judge plays the policy's first sample.

Focused memory: every real attempt (task, change, metric before and after, worked or not) is kept; at
decision time a judge sees at most `limit` earlier attempts of the same task whose change is similar
to a candidate's (similarity >= threshold), one line each ("change; worked (+1.20 points)").
Similarity is structural: an action's arguments (its words after the verb) compared position by
position, the share of the leading ones that match, so on autoresearch `set lr 0.01` against
`set lr 0.1` is 0.5 (same knob), against itself 1, against `set dropout 0.1` 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

JUDGES = ("teacher", "teacher_policy", "world_model")  # judge.by, besides none (turnopd.rollout.judge.make_judge)
MEMORY_MODES = ("none", "focused", "full", "summary")


@dataclass(frozen=True)
class Attempt:
    """One real execution of a change: `change` the action, `before` the best metric it was compared
    with and `after` the metric it reached (the env's units), `worked` whether it was kept. `order`
    places it in the run: attempts with a smaller order happened before (the step, then the turn)."""

    task_id: str
    change: str
    before: float
    after: float
    worked: bool
    order: tuple[int, ...]

    def line(self) -> str:
        return f"{self.change}; {'worked' if self.worked else 'did not work'} ({self.after - self.before:+.2f})"

    def to_json(self) -> dict:
        return asdict(self) | {"order": list(self.order)}

    @classmethod
    def from_json(cls, data: dict) -> Attempt:
        return cls(**{**data, "order": tuple(data["order"])})


def change_similarity(a: str, b: str) -> float:
    """The share of the arguments (words after the first) that match from the left, over the longer
    argument list; 1 for equal actions, 0 when the first arguments differ or either has none.
    Case-insensitive: 'set lr 0.01' vs 'set LR 0.1' -> 1/2."""
    args_a, args_b = a.lower().split()[1:], b.lower().split()[1:]
    if not args_a or not args_b:
        return float(a.strip().lower() == b.strip().lower())
    matched = 0
    for x, y in zip(args_a, args_b, strict=False):
        if x != y:
            break
        matched += 1
    return matched / max(len(args_a), len(args_b))


def earlier(attempts: Sequence[Attempt], task_id: str, before: tuple[int, ...]) -> list[Attempt]:
    """The attempts of `task_id` that happened before `before` (never the current one or a later one),
    oldest first."""
    return sorted((a for a in attempts if a.task_id == task_id and a.order < before), key=lambda a: a.order)


def focused_memory(attempts: Sequence[Attempt], task_id: str, before: tuple[int, ...], changes: Sequence[str],
                   threshold: float, limit: int = 5) -> list[Attempt]:
    """At most `limit` earlier attempts of the task whose change is at least `threshold` similar to one
    of `changes` (the candidates being judged): the most similar first, the most recent among equals."""
    scored = [(max(change_similarity(a.change, c) for c in changes), a) for a in earlier(attempts, task_id, before)]
    scored = [(s, a) for s, a in scored if s >= threshold]
    scored.sort(key=lambda sa: (-sa[0], tuple(-x for x in sa[1].order)))
    return [a for _, a in scored[:limit]]


def memory_summary(attempts: Sequence[Attempt]) -> list[str]:
    """The "summary" memory: one line per changed thing (an action's first argument: the knob), in order
    of first attempt: how often it was tried and worked, and its best result. A fixed, countable
    stand-in for Rehearse's LLM-written summary."""
    by_key: dict[str, list[Attempt]] = {}
    for a in attempts:
        words = a.change.lower().split()
        by_key.setdefault(words[1] if len(words) > 1 else a.change.lower(), []).append(a)
    lines = []
    for key, group in by_key.items():
        best = max(group, key=lambda a: a.after - a.before)
        lines.append(f"{key}: tried {len(group)}, worked {sum(a.worked for a in group)}; best {best.change} "
                     f"({best.after - best.before:+.2f})")
    return lines


def memory_lines(mode: str, attempts: Sequence[Attempt], task_id: str, before: tuple[int, ...],
                 changes: Sequence[str], threshold: float, limit: int = 5, full_limit: int = 30) -> list[str]:
    """The lines a judge reads under memory `mode` (MEMORY_MODES): none; focused (focused_memory); full
    (every earlier attempt of the task, the last `full_limit`, oldest first: a context has room for
    no more); summary (memory_summary of every earlier attempt of the task)."""
    if mode == "none":
        return []
    if mode == "focused":
        return [a.line() for a in focused_memory(attempts, task_id, before, changes, threshold, limit)]
    past = earlier(attempts, task_id, before)
    if mode == "full":
        return [a.line() for a in past[-full_limit:]]
    if mode == "summary":
        return memory_summary(past)
    raise ValueError(f"judge memory must be one of {', '.join(MEMORY_MODES)}, got {mode!r}")


@dataclass(frozen=True)
class Decision:
    """The state a turn's candidates are judged in: the task, the goal, the episode's first observation,
    its (observation, action) history and the current observation; `order` is (step, turn): the
    memory shown holds only attempts before it; `episode` the episode's index in its batch."""

    task_id: str
    episode: int
    goal: str
    first_observation: str
    history: Sequence[tuple[str, str]]
    observation: str
    order: tuple[int, int]


@dataclass(frozen=True)
class Tournament:
    """The votes of a strict-consensus round robin: `votes[c]` the pairs candidate c won in both
    orders, `verdicts` the pairs that gave a vote, `pairs` all pairs asked, `chosen` the candidate to
    run (most votes, the earliest among equals: 0 when the judge abstained on every pair)."""

    votes: tuple[int, ...]
    verdicts: int
    pairs: int
    chosen: int


def consensus(first: int | None, second: int | None) -> int | None:
    """A pair's vote from its two orders' picks (candidate indices; None: no pick): the pick when both
    orders agree on it, else None (an abstention)."""
    return first if first is not None and first == second else None


def round_robin(k: int, pick: Callable[[int, int], int | None]) -> Tournament:
    """Every pair i < j of k candidates asked in both orders, `pick(x, y)` being the judge's choice
    (x, y or None) when shown x first; see Tournament."""
    votes = [0] * k
    verdicts = pairs = 0
    for i in range(k):
        for j in range(i + 1, k):
            pairs += 1
            vote = consensus(pick(i, j), pick(j, i))
            if vote is not None:
                votes[vote] += 1
                verdicts += 1
    return Tournament(tuple(votes), verdicts, pairs, max(range(k), key=lambda c: (votes[c], -c)))
