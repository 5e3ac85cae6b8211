"""The small typed records that flow through TurnOPD: a Turn, a Trajectory, a flat TokenBatch.

Token convention everywhere: a log-prob stored "at token p" is log pi(token_p | tokens_<p).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class AlignedSpan:
    """Student tokens [student_start, student_end) and teacher tokens [teacher_start, teacher_end) of
    one action that hold the same bytes, under a teacher of another tokenizer (a tail span holds no
    teacher token: turnopd.algorithm.token_alignment)."""

    student_start: int
    student_end: int
    teacher_start: int
    teacher_end: int


@dataclass
class Turn:
    """One decision of the agent: the prompt it saw, the tokens it generated, and their scores."""

    index: int
    observation: str
    prompt_ids: list[int]
    action_ids: list[int]
    student_logprobs: list[float]
    action_text: str = ""
    teacher_logprobs: list[float] | None = None
    # Optional teacher top-k per action token: ids [n_action][k] and their log-probs.
    teacher_topk_ids: list[list[int]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None
    reward: float = 0.0
    invalid: bool = False
    # The teacher's familiarity signals of this turn, by name (turnopd.algorithm.familiarity), when scored.
    teacher_signals: dict[str, float] = field(default_factory=dict)
    # An env that shows screenshots: the pixel-store keys (turnopd.core.pixels) of the images in
    # prompt_ids, in the order of their placeholders, and the prompt a text teacher reads instead
    # (the pages' text where the student saw images; None: the teacher reads prompt_ids).
    image_keys: list[str] = field(default_factory=list)
    teacher_prompt_ids: list[int] | None = None
    # A teacher of another tokenizer (objective.tokenizers=cross): the action's text in the teacher's
    # tokens, and the spans aligning them with action_ids (teacher_prompt_ids: the turn in its template)
    teacher_action_ids: list[int] | None = None
    token_spans: list[AlignedSpan] | None = None

    def __post_init__(self) -> None:
        if len(self.student_logprobs) != len(self.action_ids):
            raise ValueError(
                f"turn {self.index}: {len(self.action_ids)} action tokens but "
                f"{len(self.student_logprobs)} student log-probs"
            )


@dataclass
class Trajectory:
    """One episode of one task, as played by the student (possibly stopped by the depth cap)."""

    task_id: str
    env_name: str
    turns: list[Turn] = field(default_factory=list)
    success: bool = False
    truncated: bool = False  # stopped by the rollout-depth cap before the env ended it
    is_probe: bool = False  # a full-depth probe rollout for the depth controller
    task_type: str = ""
    env_error: str = ""  # why the env, not the agent, ended this episode (a worker crash or hang, an env exception)
    goal: str = ""  # the task's goal text, as the env's reset gave it
    ended: bool = False  # the env ended the episode (won, lost or an env error); False: stopped while playing
    final_observation: str = ""  # the env's answer to the last turn's action (what the last turn led to)
    # a factor on the loss weights of its tokens (an add-on's, e.g. a world model's denoising; None: 1)
    loss_weight: float | None = None
    # the reward term's advantage of the episode's outcome (objective.reward_weight > 0; None: not computed)
    advantage: float | None = None
    # what add-ons recorded of the episode, each under its own name and in its own typed record (the
    # world model's: turnopd.rollout.world_model_pool.WorldModelTrace)
    addons: dict[str, Any] = field(default_factory=dict)
    weight_version: int = 0  # policy weight version that generated it (async pipelines)

    @property
    def failed_by_env(self) -> bool:
        return bool(self.env_error)

    @property
    def depth(self) -> int:
        return len(self.turns)

    @property
    def invalid_actions(self) -> int:
        return sum(turn.invalid for turn in self.turns)

    @property
    def num_action_tokens(self) -> int:
        return sum(len(turn.action_ids) for turn in self.turns)


@dataclass
class ScoredSequence:
    """A token sequence to run through a model once, with the spans of student action tokens.

    spans: (start, end, turn_index) -- tokens ids[start:end] are turn `turn_index`'s action.
    """

    ids: list[int]
    spans: list[tuple[int, int, int]]
    image_keys: list[str] = field(default_factory=list)  # the screenshots of its image placeholders, in order


def trajectory_sequences(traj: Trajectory, reader: str = "student") -> list[ScoredSequence]:
    """Split a trajectory into the fewest sequences that reproduce what the `reader` saw: the
    student (its prompts, with their screenshots) or the teacher (Turn.teacher_prompt_ids where a
    turn has them: a text teacher of a student that reads screenshots, or a teacher of another
    tokenizer, which also reads the actions in its own tokens, Turn.teacher_action_ids; a span then
    covers those).

    When every turn's prompt extends the previous prompt + action (a multi-turn chat that only
    appends), the whole trajectory is ONE sequence and one forward pass scores every turn. When
    the prompt re-renders a history window (verl-agent style), a turn's prompt is not such an
    extension and starts a new sequence, so each turn is scored on exactly the window it saw.
    A sequence's screenshots are its last turn's (a prompt that extends another holds its images).
    """
    if reader not in ("student", "teacher"):
        raise ValueError(f"reader must be 'student' or 'teacher', got {reader!r}")
    sequences: list[ScoredSequence] = []
    for turn in traj.turns:
        teacher_text = reader == "teacher" and turn.teacher_prompt_ids is not None
        prompt = turn.teacher_prompt_ids if teacher_text else turn.prompt_ids
        current = sequences[-1] if sequences else None
        if current is not None and prompt[: len(current.ids)] == current.ids:
            current.ids.extend(prompt[len(current.ids) :])
        else:
            current = ScoredSequence(ids=list(prompt), spans=[])
            sequences.append(current)
        current.image_keys = [] if teacher_text else list(turn.image_keys)
        start = len(current.ids)
        own_tokens = reader == "teacher" and turn.teacher_action_ids is not None
        current.ids.extend(turn.teacher_action_ids if own_tokens else turn.action_ids)
        current.spans.append((start, len(current.ids), turn.index))
    return sequences


@dataclass
class TokenBatch:
    """Trajectories flattened into concatenated sequences (1-D tensors, split by `seq_lens`).

    loss_mask marks student action tokens; traj_ids / turn_ids give, per token, the index of its
    trajectory in the batch and its turn (-1 on prompt tokens). old_logprobs are the student's
    sampling log-probs, teacher_logprobs the teacher's (0 where not scored).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    traj_ids: torch.Tensor
    turn_ids: torch.Tensor
    old_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor
    seq_lens: torch.Tensor
    num_trajectories: int
    teacher_topk_ids: torch.Tensor | None = None  # [N, k] (0 off the mask)
    teacher_topk_logprobs: torch.Tensor | None = None  # [N, k] (-inf off the mask)
    # per familiarity signal, each action token's turn value (NaN off the mask and where not scored)
    turn_signals: dict[str, torch.Tensor] = field(default_factory=dict)
    # [num_trajectories] loss-weight factor per trajectory (Trajectory.loss_weight, 1 where it
    # has none); None: no trajectory carries one
    trajectory_weights: torch.Tensor | None = None
    # [num_trajectories] the reward term's advantage per trajectory (Trajectory.advantage, 0 where it has
    # none); None: no trajectory carries one
    advantages: torch.Tensor | None = None
    # per sequence, the pixel-store keys of its screenshots in placeholder order (empty: none; [] for a
    # batch of text only)
    image_keys: list[list[str]] = field(default_factory=list)
    # each trajectory's env (a multi-env run's in-process teachers: which one reads its sequences)
    trajectory_envs: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_action_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def sequences(self) -> list[slice]:
        """Slices of the flat tensors, one per sequence."""
        ends = torch.cumsum(self.seq_lens, 0).tolist()
        starts = [0, *ends[:-1]] if ends else []
        return [slice(s, e) for s, e in zip(starts, ends, strict=True)]


def build_token_batch(trajectories: list[Trajectory]) -> TokenBatch:
    """Flatten scored trajectories into a TokenBatch (see `trajectory_sequences`)."""
    ids: list[int] = []
    mask: list[bool] = []
    traj_ids: list[int] = []
    turn_ids: list[int] = []
    old_lp: list[float] = []
    teacher_lp: list[float] = []
    seq_lens: list[int] = []
    topk_rows: list[tuple[int, list[int], list[float]]] = []  # (flat position, ids, logprobs)
    signal_rows: list[tuple[int, dict[str, float]]] = []  # (flat position, its turn's signals)
    image_keys: list[list[str]] = []
    for traj_index, traj in enumerate(trajectories):
        turns = {turn.index: turn for turn in traj.turns}
        for seq in trajectory_sequences(traj):
            image_keys.append(seq.image_keys)
            offset, n = len(ids), len(seq.ids)
            ids.extend(seq.ids)
            mask.extend([False] * n)
            traj_ids.extend([traj_index] * n)
            turn_ids.extend([-1] * n)
            old_lp.extend([0.0] * n)
            teacher_lp.extend([0.0] * n)
            for start, end, turn_index in seq.spans:
                turn = turns[turn_index]
                for j, p in enumerate(range(offset + start, offset + end)):
                    mask[p], turn_ids[p], old_lp[p] = True, turn_index, turn.student_logprobs[j]
                    if turn.teacher_logprobs is not None:
                        teacher_lp[p] = turn.teacher_logprobs[j]
                    if turn.teacher_topk_ids is not None and turn.teacher_topk_logprobs is not None:
                        topk_rows.append((p, turn.teacher_topk_ids[j], turn.teacher_topk_logprobs[j]))
                    if turn.teacher_signals:
                        signal_rows.append((p, turn.teacher_signals))
            seq_lens.append(n)
    topk_ids, topk_lp = _topk_tensors(topk_rows, len(ids))
    return TokenBatch(
        input_ids=torch.tensor(ids, dtype=torch.long), loss_mask=torch.tensor(mask, dtype=torch.bool),
        traj_ids=torch.tensor(traj_ids, dtype=torch.long), turn_ids=torch.tensor(turn_ids, dtype=torch.long),
        old_logprobs=torch.tensor(old_lp, dtype=torch.float32),
        teacher_logprobs=torch.tensor(teacher_lp, dtype=torch.float32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long), num_trajectories=len(trajectories),
        teacher_topk_ids=topk_ids, teacher_topk_logprobs=topk_lp, turn_signals=_signal_tensors(signal_rows, len(ids)),
        trajectory_weights=_per_trajectory([t.loss_weight for t in trajectories], 1.0),
        advantages=_per_trajectory([t.advantage for t in trajectories], 0.0),
        image_keys=image_keys if any(image_keys) else [], trajectory_envs=[t.env_name for t in trajectories],
    )


def _topk_tensors(rows: list[tuple[int, list[int], list[float]]], n: int
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """[n, k] top-k ids (0 elsewhere) and log-probs (-inf elsewhere) from (position, ids, log-probs) rows."""
    if not rows:
        return None, None
    k = max(len(row[1]) for row in rows)
    topk_ids = torch.zeros(n, k, dtype=torch.long)
    topk_lp = torch.full((n, k), float("-inf"))
    for p, row_ids, row_lp in rows:
        topk_ids[p, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        topk_lp[p, : len(row_lp)] = torch.tensor(row_lp, dtype=torch.float32)
    return topk_ids, topk_lp


def _signal_tensors(rows: list[tuple[int, dict[str, float]]], n: int) -> dict[str, torch.Tensor]:
    """Per signal name, [n] values at the rows' positions (NaN elsewhere)."""
    out: dict[str, torch.Tensor] = {}
    for p, signals in rows:
        for name, value in signals.items():
            out.setdefault(name, torch.full((n,), float("nan")))[p] = value
    return out


def _per_trajectory(values: list[float | None], default: float) -> torch.Tensor | None:
    """[num_trajectories] float64 values (`default` for None); None when no trajectory has one."""
    if all(v is None for v in values):
        return None
    return torch.tensor([default if v is None else v for v in values], dtype=torch.float64)


@dataclass(frozen=True)
class EpisodeSummary:
    """The outcome of a trajectory without its tokens (cheap to gather across ranks)."""

    task_id: str
    task_type: str
    success: bool
    depth: int
    truncated: bool
    invalid_actions: int
    action_tokens: int
    env_error: str
    scored_tokens: int = 0  # tokens the teacher runs through to score it (trajectory_sequences)
    is_probe: bool = False  # a full-depth probe for the depth controller
    addons: dict[str, Any] = field(default_factory=dict)  # Trajectory.addons
    env_name: str = ""  # the env it played (a multi-env run's records are per env)

    @property
    def failed_by_env(self) -> bool:
        return bool(self.env_error)

    @classmethod
    def of(cls, traj: Trajectory) -> EpisodeSummary:
        return cls(traj.task_id, traj.task_type, traj.success, traj.depth, traj.truncated,
                   traj.invalid_actions, traj.num_action_tokens, traj.env_error,
                   sum(len(seq.ids) for seq in trajectory_sequences(traj, "teacher")), traj.is_probe, dict(traj.addons),
                   traj.env_name)


MAX_ERRORS_SHOWN = 2  # an error message names its game, so one cause can read as many messages


def env_errors(episodes: Iterable[Trajectory | EpisodeSummary]) -> dict[str, int]:
    """How many episodes each distinct env error ended, most frequent first (empty: the env ended none)."""
    return dict(Counter(e.env_error for e in episodes if e.env_error).most_common())


def describe_env_errors(errors: dict[str, int], episodes: int) -> str:
    """One line for a person: '3 of 8 episodes were ended by the env, not the agent: MESSAGE (x2); ...'."""
    shown = list(errors.items())[:MAX_ERRORS_SHOWN]
    more = len(errors) - len(shown)
    return (f"{sum(errors.values())} of {episodes} episodes were ended by the env, not the agent: "
            + "; ".join(f"{message} (x{count})" for message, count in shown)
            + (f"; and {more} other errors" if more else ""))
