"""The Teacher protocol, its per-token scores, the backend registry, and the tokenizer guard.

Score convention (as everywhere in TurnOPD): position p of a sequence holds
log p_teacher(ids[p] | ids[:p]). Position 0 has no context and holds 0.0 (its top-k lists are
empty); TurnOPD reads only student action tokens, which always follow a prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from turnopd.core.registry import Registry


@dataclass
class TokenScores:
    """A teacher's scores of one sequence, one entry per position (see the module docstring).

    With top-k asked: topk_ids[p] / topk_logprobs[p] are the teacher's k most likely tokens at
    position p (given ids[:p]) and their log-probs, most likely first. entropy[p]: the entropy of
    the teacher's whole distribution at position p, from a backend that has it (transformers).
    """

    logprobs: list[float]
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    entropy: list[float] | None = None


class Teacher(Protocol):
    """Scores token sequences. Backends: transformers (local; has `.model`, the nn.Module), vllm
    (in-process), vllm_server (an OpenAI-compatible vLLM server); each subclasses this protocol, so
    that a capability it does not have reads as its default here.

    Capabilities: the pre-flight checks (turnopd.orchestration.preflight) read `provides_model`,
    `scores_entropy` and `max_topk` from a backend's class, before any model loads."""

    name: str
    tokenizer: Any
    max_length: int
    # the teacher's nn.Module is in this process, as `.model`: what a full-vocabulary estimator needs
    provides_model: ClassVar[bool] = False
    # its scores carry the exact entropy of every position; else familiarity's action_entropy needs a top-k
    scores_entropy: ClassVar[bool] = False
    # a vision-language teacher: it scores the student's own sequences, screenshots included (`image_keys`)
    reads_screenshots: bool = False

    @staticmethod
    def max_topk(spec: Any) -> int | None:
        """The largest top-k the backend scores for a teacher spec (None: no limit)."""
        return None

    # image_keys (a teacher that `reads_screenshots`): per sequence, the pixel-store keys of its images
    def score(self, sequences: list[list[int]], topk: int = 0, image_keys: list[list[str]] | None = None
              ) -> list[TokenScores]: ...
    def close(self) -> None: ...


# Backends are classes (Teacher subclasses, their capabilities declared there) constructed from a
# TeacherSpec (teachers.spec): TEACHER_BACKENDS.get(name)(spec).
TEACHER_BACKENDS: Registry[Callable[..., Teacher]] = Registry("teacher backend")


def check_sequences(sequences: list[list[int]], max_length: int, teacher: str) -> None:
    """Every sequence non-empty and within the teacher's max_length, before any scoring."""
    for i, seq in enumerate(sequences):
        if not seq:
            raise ValueError(f"teacher {teacher}: sequence {i} is empty")
        if len(seq) > max_length:
            raise ValueError(f"teacher {teacher}: sequence {i} has {len(seq)} tokens > its max_length {max_length}")


class TokenizerMismatchError(ValueError):
    """Student and teacher do not tokenize alike: the teacher would score tokens it never saw."""


PROBE_TEXT = ("You are in the middle of a room. Your task is to: put a clean mug in coffeemachine. "
              "<think>First find the mug.</think><action>go to countertop 1</action> 42 café 😀\n\t done.")


def check_tokenizers(student_tokenizer: Any, teacher_tokenizer: Any, student_name: str, teacher_name: str,
                     probe_text: str = PROBE_TEXT) -> None:
    """Fail unless student and teacher tokenizers agree: the same vocabulary size, the same ids for a
    probe text, and (where both have a chat template) the same ids for a probe chat prompt.

    Equal vocabulary sizes are required, not just overlap: the teacher's top-k ids index the
    student's vocabulary.
    """
    def fail(what: str) -> None:
        raise TokenizerMismatchError(f"student tokenizer ({student_name}) and teacher tokenizer ({teacher_name}) "
                                     f"differ: {what}. With objective.tokenizers=match the teacher scores the "
                                     "student's own tokens; set objective.tokenizers=cross to distil across "
                                     "tokenizers (sampled-token estimators), or use a teacher that shares the "
                                     "student's tokenizer")

    if teacher_tokenizer is None:
        fail("the teacher has no tokenizer to check (a vllm_server teacher reads it from spec.tokenizer or spec.model)")
    sizes = len(student_tokenizer), len(teacher_tokenizer)
    if sizes[0] != sizes[1]:
        fail(f"vocabulary sizes {sizes[0]} vs {sizes[1]}")
    ids = [tok(probe_text, add_special_tokens=False)["input_ids"] for tok in (student_tokenizer, teacher_tokenizer)]
    if ids[0] != ids[1]:
        first = next((i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), min(map(len, ids)))
        fail(f"ids for the probe text {probe_text!r} differ from token {first} "
             f"({ids[0][first : first + 5]} vs {ids[1][first : first + 5]})")
    if getattr(student_tokenizer, "chat_template", None) and getattr(teacher_tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": probe_text}]
        rendered = [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
                    for tok in (student_tokenizer, teacher_tokenizer)]
        if list(rendered[0]) != list(rendered[1]):
            fail("their chat templates render a probe message to different ids")
