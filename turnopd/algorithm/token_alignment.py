"""Cross-tokenizer teachers (objective.tokenizers=cross): the student's action text in two
tokenizations, aligned into spans, and the teacher's log-probs carried to the student's tokens.

Pure functions (a tokenizer is read only through `convert_ids_to_tokens`, `all_special_ids` and
`encode`). The choice, docs/algorithm.md ("Teachers of another tokenizer"):

- ALIGN on bytes. Each token's bytes are read from its vocabulary entry (a byte-level BPE's
  characters mapped back to bytes, a byte-fallback `<0xNN>` to its byte, SentencePiece's `▁` to a
  space; a special token has no text: b""). The teacher reads the student's text less what is no
  UTF-8 character (an answer cut by max_new_tokens inside a character), and its tokenizer may drop
  more (SmolLM2's drops some control bytes), so the two byte strings are matched into blocks of
  equal bytes (difflib). A boundary is a token boundary of both sides at the same place of one
  block, and a SPAN is the tokens of each side between two boundaries of one block: the same bytes
  on both sides, so the log-probs of its tokens on each side are the log-probs of the same text
  (GOLD's alignment groups, TRL gold_trainer, on bytes instead of incrementally decoded strings, so
  a character split over byte tokens aligns too; rLLM's distill/alignment.py splits each teacher
  token's log-prob over the student tokens it overlaps instead, which mixes log-probs of different
  texts).
- A student token without text (a special token it sampled) joins the span that starts where it
  stands. Student tokens between boundaries of different blocks (around bytes one side does not
  hold) or after the last boundary (its end-of-turn token; the cut character) form a span with no
  teacher tokens: the teacher cannot read them as the student wrote them.
- SPREAD: a span's teacher log-prob is T_span = sum of its teacher tokens' log-probs (the teacher's
  log-prob of the span's text), the student's S_span = sum of its tokens' sampling log-probs s_old;
  every student token p of a span of n tokens gets the teacher log-prob

      T'_p = s_old_p + (T_span - S_span) / n        (a span without teacher tokens: T'_p = s_old_p)

  so sum_p T'_p = T_span and each token's sampled log-ratio T'_p - s_old_p is an equal share of the
  span's. The estimators read T' as they read a same-tokenizer teacher's log-probs; with identical
  tokenizers every span is one token and T' = T (up to float rounding).
- TOP-K (estimator topk_cross, turnopd.algorithm.objective.topk_cross_loss): the two next-token
  distributions correspond where the prefix bytes do, at a span's first token (a boundary of both
  tokenizations), so the teacher's top-k of its span's first token is kept at the student's first
  token of the span (`span_first_topk`), in the teacher's ids; the VOCABULARY MAP (`vocab_map`, once
  per pair of tokenizers) pairs the ids of the texts both vocabularies hold.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from functools import cache
from typing import Any

import torch

from turnopd.core.types import AlignedSpan

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte (printable
    Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 onwards), as char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def piece_bytes(piece: str) -> bytes:
    """The bytes of one vocabulary entry: a `<0xNN>` byte fallback (first: its characters are also
    byte-level BPE ones), byte-level BPE characters, else its UTF-8 with SentencePiece's word marker
    `▁` read as a space."""
    fallback = _BYTE_FALLBACK.match(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    alphabet = byte_level_alphabet()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return piece.replace("▁", " ").encode("utf-8")


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes]:
    """Each token's bytes (b"" for a special token: it has no text), [len(ids)]."""
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    return [b"" if i in special else piece_bytes(p) for i, p in zip(ids, pieces, strict=True)]


def _offsets(pieces: Sequence[bytes]) -> list[int]:
    out = [0]
    for piece in pieces:
        out.append(out[-1] + len(piece))
    return out


def _matched_points(student: bytes, teacher: bytes, s_off: Sequence[int], t_off: Sequence[int]
                    ) -> list[tuple[int, int, int]]:
    """The boundaries, in order: (student offset, teacher offset, matching block) of the token
    boundaries of both sides that stand at the same place of a block of equal bytes (difflib's
    matching blocks of the two byte strings)."""
    t_set, points = set(t_off), []
    blocks = SequenceMatcher(None, student, teacher, autojunk=False).get_matching_blocks()
    for block, (i, j, size) in enumerate(blocks[:-1]):  # the last is difflib's empty sentinel
        points += [(s, j + s - i, block) for s in sorted(set(s_off)) if i <= s <= i + size and j + s - i in t_set]
    return points


def aligned_spans(student: Sequence[bytes], teacher: Sequence[bytes]) -> list[AlignedSpan]:
    """The spans of two tokenizations (each token's bytes) of one text (see the module docstring):
    consecutive, covering every student token [n] once. Between two boundaries of one block of
    equal bytes, a span holds the tokens of each side that start there; bytes one side does not hold
    (a byte the teacher's tokenizer drops, invalid UTF-8 the student sampled, the student's tokens
    after the last boundary) put the student's tokens up to the next boundary in a span without
    teacher tokens."""
    s_off, t_off = _offsets(student), _offsets(teacher)
    s_starts, t_starts = s_off[:-1], t_off[:-1]
    spans, previous = [], (0, 0, None)
    for point in [*_matched_points(b"".join(student), b"".join(teacher), s_off, t_off), (s_off[-1] + 1, 0, None)]:
        # the tokens that start before a boundary end by it; the end sentinel takes the student's rest
        i0, i = bisect_left(s_starts, previous[0]), bisect_left(s_starts, point[0])
        j0, j = bisect_left(t_starts, previous[1]), bisect_left(t_starts, point[1])
        matched = point[2] is not None and point[2] == previous[2]
        if i > i0:
            spans.append(AlignedSpan(i0, i, j0, j) if matched else AlignedSpan(i0, i, j0, j0))
        previous = point
    return spans


@dataclass(frozen=True)
class CrossTokens:
    """A student's action as a teacher of another tokenizer reads it: the teacher's ids of its text
    and the spans aligning them with the student's ids."""

    teacher_ids: list[int]
    spans: list[AlignedSpan]


def cross_tokens(student_tokenizer: Any, teacher_tokenizer: Any, student_ids: Sequence[int]) -> CrossTokens:
    """The student's action `student_ids` in the teacher's tokenizer: its text (special tokens and
    bytes that are no UTF-8 character left out) encoded on its own, and the aligned spans."""
    pieces = token_bytes(student_tokenizer, student_ids)
    text = b"".join(pieces).decode("utf-8", errors="ignore")
    teacher_ids = list(teacher_tokenizer.encode(text, add_special_tokens=False))
    return CrossTokens(teacher_ids, aligned_spans(pieces, token_bytes(teacher_tokenizer, teacher_ids)))


def spread_teacher_logprobs(spans: Sequence[AlignedSpan], teacher_logprobs: Sequence[float],
                            sampling_logprobs: Sequence[float]) -> list[float]:
    """T'_p for every student token p (module docstring): T'_p = s_old_p + (T_span - S_span) / n over
    each span of n student tokens with teacher tokens, s_old_p on a span without. teacher_logprobs [m]
    (the teacher's action tokens), sampling_logprobs [n]; returns [n]."""
    out = list(sampling_logprobs)
    for span in spans:
        n = span.student_end - span.student_start
        if span.teacher_end == span.teacher_start:
            continue
        share = (sum(teacher_logprobs[span.teacher_start : span.teacher_end])
                 - sum(sampling_logprobs[span.student_start : span.student_end])) / n
        for p in range(span.student_start, span.student_end):
            out[p] = sampling_logprobs[p] + share
    return out


def span_first_topk(spans: Sequence[AlignedSpan], topk_ids: Sequence[list[int]], topk_logprobs: Sequence[list[float]]
                    ) -> tuple[list[list[int]], list[list[float]]]:
    """The teacher's top-k over its vocabulary carried to the student's tokens: at the first student
    token of each span with teacher tokens, the teacher's ids and log-probs at the span's first teacher
    token (both predict the span's first token after the same bytes); [] at every other student token.
    topk_ids / topk_logprobs [m][k] (the teacher's action tokens); returns two [n][k or 0]."""
    n = spans[-1].student_end if spans else 0
    ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    for span in spans:
        if span.teacher_end > span.teacher_start:
            ids[span.student_start] = list(topk_ids[span.teacher_start])
            logprobs[span.student_start] = list(topk_logprobs[span.teacher_start])
    return ids, logprobs


@dataclass(frozen=True)
class VocabMap:
    """The texts two vocabularies share, as ids (`vocab_map`)."""

    student_of_teacher: torch.Tensor  # [V_t] long: the student id of each teacher id's text, -1 where none
    student_only: torch.Tensor  # [V_s] bool: the student ids no teacher id is paired with

    def student_ids(self, teacher_ids: torch.Tensor) -> torch.Tensor:
        """Teacher ids (any shape) as student ids, -1 where the student's vocabulary lacks the text (and
        for an id past the teacher's tokenizer: a padding row of its head)."""
        size = self.student_of_teacher.shape[0]
        inside = teacher_ids < size
        return torch.where(inside, self.student_of_teacher[teacher_ids.clamp(max=size - 1)], -1)

    def rest_mask(self, rows: int) -> torch.Tensor:
        """`student_only` over a student head of `rows` >= V_s rows, [rows]: the rows past the tokenizer's
        ids are no token's text and left out (False)."""
        return torch.cat([self.student_only, torch.zeros(rows - self.student_only.shape[0], dtype=torch.bool)])


def _texts(tokenizer: Any) -> dict[bytes | str, int]:
    """Each text of a vocabulary -> its id: a special token's text is its string, any other token's its
    bytes (`piece_bytes`); of ids of the same bytes, a `<0xNN>` byte fallback yields to a token that
    spells them, else the first id is kept (so the map is one-to-one)."""
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    out: dict[bytes | str, int] = {}
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        text = piece if i in special else piece_bytes(piece)
        if text not in out or (_BYTE_FALLBACK.match(pieces[out[text]]) and not _BYTE_FALLBACK.match(piece)):
            out[text] = i
    return out


@cache
def vocab_map(student_tokenizer: Any, teacher_tokenizer: Any) -> VocabMap:
    """The vocabulary map of a (student, teacher) pair of tokenizers, computed once per pair: the ids
    of each text both hold (`_texts`: bytes, as the alignment reads tokens; special tokens by their
    string, so `<|im_end|>` pairs with `<|im_end|>`)."""
    student, teacher = _texts(student_tokenizer), _texts(teacher_tokenizer)
    to_student = torch.full((len(teacher_tokenizer),), -1, dtype=torch.long)
    student_only = torch.ones(len(student_tokenizer), dtype=torch.bool)
    for text, teacher_id in teacher.items():
        if text in student:
            to_student[teacher_id] = student[text]
            student_only[student[text]] = False
    return VocabMap(to_student, student_only)
