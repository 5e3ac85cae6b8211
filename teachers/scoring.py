"""Teacher scoring of student trajectories, routed by env name.

Each trajectory is split into the fewest sequences that reproduce what the student saw
(turnopd.core.types.trajectory_sequences): ONE sequence for the whole trajectory when every prompt
extends the previous prompt + answer (a chat that only appends), else one per turn window (the
rollout engine's prompts re-render a history window each turn, so its trajectories score one
window per turn). All sequences of all trajectories that share a teacher go to it in one call, so
the backend batches across trajectories. The student's action tokens are read out, and each turn's
familiarity signals (turnopd.algorithm.familiarity) from the same scores: no extra forward. A turn
with a text prompt of its own for the teacher (a student that reads screenshots,
Turn.teacher_prompt_ids) is scored on it: the same action tokens after the pages' text. A teacher
of another tokenizer (objective.tokenizers=cross) scores each turn in its own template and tokens
(Turn.teacher_prompt_ids, Turn.teacher_action_ids), and its log-probs reach the student's tokens
through the turn's aligned spans (turnopd.algorithm.token_alignment.spread_teacher_logprobs); its
top-k, over its own vocabulary and in its own ids, is kept at each span's first student token
(token_alignment.span_first_topk), where estimator topk_cross reads it through the vocabulary map.
"""

from __future__ import annotations

from collections.abc import Sequence

from teachers.base import Teacher, TokenScores
from turnopd.algorithm.familiarity import span_signals, topk_tail_entropy
from turnopd.algorithm.token_alignment import span_first_topk, spread_teacher_logprobs
from turnopd.core.types import ScoredSequence, Trajectory, trajectory_sequences


def score_trajectories(teachers_by_env: dict[str, Teacher], trajectories: Sequence[Trajectory],
                       topk: int = 0) -> int:
    """Fill each turn's teacher_logprobs (and teacher_topk_* when topk > 0) in place.

    Returns the number of tokens the teachers scored (prompts included).
    """
    missing = sorted({t.env_name for t in trajectories} - set(teachers_by_env))
    if missing:
        raise KeyError(f"no teacher for env(s) {', '.join(missing)}; teachers are configured for "
                       f"{', '.join(sorted(teachers_by_env)) or 'no env'} (recipe key `teachers`)")
    work: dict[int, list[tuple[Trajectory, ScoredSequence]]] = {}  # by teacher, so shared ones batch
    teachers: dict[int, Teacher] = {}
    for traj in trajectories:
        teacher = teachers_by_env[traj.env_name]
        teachers[id(teacher)] = teacher
        # a teacher that reads screenshots sees what the student saw; a text teacher its own text prompts
        for seq in trajectory_sequences(traj, "student" if teacher.reads_screenshots else "teacher"):
            if len(seq.ids) > teacher.max_length:
                raise ValueError(f"trajectory of task {traj.task_id} has a sequence of {len(seq.ids)} tokens > "
                                 f"teacher {teacher.name}'s max_length {teacher.max_length}")
            work.setdefault(id(teacher), []).append((traj, seq))
    scored_tokens = 0
    for key, items in work.items():
        images = [seq.image_keys for _, seq in items]
        all_scores = teachers[key].score([seq.ids for _, seq in items], topk=topk,
                                         **({"image_keys": images} if any(images) else {}))
        for (traj, seq), scores in zip(items, all_scores, strict=True):
            turns = {turn.index: turn for turn in traj.turns}
            signals = span_signals(scores.logprobs, [(start, end) for start, end, _ in seq.spans],
                                   action_entropies(scores, seq.spans))
            for (start, end, turn_index), turn_signals in zip(seq.spans, signals, strict=True):
                turn = turns[turn_index]
                turn.teacher_signals = turn_signals
                if turn.token_spans is not None:  # its own tokens: carried to the student's by the spans
                    turn.teacher_logprobs = spread_teacher_logprobs(turn.token_spans, scores.logprobs[start:end],
                                                                    turn.student_logprobs)
                    if topk:  # in its own ids, at each span's first student token (topk_cross maps them)
                        turn.teacher_topk_ids, turn.teacher_topk_logprobs = span_first_topk(
                            turn.token_spans, scores.topk_ids[start:end], scores.topk_logprobs[start:end])
                    continue
                turn.teacher_logprobs = scores.logprobs[start:end]
                if topk:
                    turn.teacher_topk_ids = scores.topk_ids[start:end]
                    turn.teacher_topk_logprobs = scores.topk_logprobs[start:end]
            scored_tokens += len(seq.ids)
    return scored_tokens


def action_entropies(scores: TokenScores, spans: Sequence[tuple[int, int, int]]) -> list[float] | None:
    """The teacher's entropy at each position (read at the action spans only): exact when the backend
    scored it (TokenScores.entropy), else from its top-k and a tail bucket, else None (no top-k)."""
    if scores.entropy is not None:
        return scores.entropy
    if not scores.topk_logprobs:
        return None
    out = [0.0] * len(scores.logprobs)
    for start, end, _ in spans:
        for p in range(start, end):
            out[p] = topk_tail_entropy(scores.topk_logprobs[p])
    return out
