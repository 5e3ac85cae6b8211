"""Cross-tokenizer teachers (objective.tokenizers=cross): the student's action text in two
tokenizations, aligned into spans, and the teacher's log-probs carried to the student's tokens.

Pure functions (a tokenizer is read only through `convert_ids_to_tokens`, `all_special_ids` and
`encode`). The choice, docs/algorithm.md ("Teachers of another tokenizer"):

- ALIGN on bytes. Each token's bytes are read from its vocabulary entry (a byte-level BPE's
  characters mapped back to bytes, a byte-fallback `<0xNN>` to its byte, SentencePiece's `▁` to a
  space; a special token has no text: b""). With S_0 = 0 < S_1 <= ... <= S_n the student's cumulative
  byte offsets and T_0 = 0 < ... <= T_m the teacher's, a boundary is an offset in both, and a SPAN is
  the tokens of each side between two consecutive boundaries: the same bytes on both sides, so the
  log-probs of its tokens on each side are the log-probs of the same text (GOLD's alignment groups,
  TRL gold_trainer, on bytes instead of incrementally decoded strings, so a character split over
  byte tokens aligns too; rLLM's distill/alignment.py splits each teacher token's log-prob over the
  student tokens it overlaps instead, which mixes log-probs of different texts).
- A student token without text (a special token it sampled) joins the span that starts where it
  stands; the student's tokens after the last boundary (such a token at the end of the answer, its
  end-of-turn token; an answer cut by
  max_new_tokens inside a character, or bytes that are no character, which the teacher's text stops
  before) form a TAIL span with no teacher tokens: the teacher cannot read them.
- SPREAD: a span's teacher log-prob is T_span = sum of its teacher tokens' log-probs (the teacher's
  log-prob of the span's text), the student's S_span = sum of its tokens' sampling log-probs s_old;
  every student token p of a span of n tokens gets the teacher log-prob

      T'_p = s_old_p + (T_span - S_span) / n        (a tail span: T'_p = s_old_p, log-ratio 0)

  so sum_p T'_p = T_span and each token's sampled log-ratio T'_p - s_old_p is an equal share of the
  span's. The estimators read T' as they read a same-tokenizer teacher's log-probs; with identical
  tokenizers every span is one token and T' = T exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

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


def valid_text(data: bytes) -> str:
    """The text of `data` up to its first byte that is not part of a whole UTF-8 character (an answer
    cut by the token limit may end inside a character; a sampled byte sequence may be no character)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as bad:
        return data[: bad.start].decode("utf-8")


def _offsets(pieces: Sequence[bytes]) -> list[int]:
    out = [0]
    for piece in pieces:
        out.append(out[-1] + len(piece))
    return out


def aligned_spans(student: Sequence[bytes], teacher: Sequence[bytes]) -> list[AlignedSpan]:
    """The spans of two tokenizations (each token's bytes) of one text, the teacher's a prefix of the
    student's (see the module docstring): consecutive, covering every student token [n] once; the
    teacher tokens after the last boundary, if any, are in none."""
    joined = b"".join(teacher)
    if not b"".join(student).startswith(joined):
        raise ValueError(f"the teacher's text {joined[:60]!r} is not a prefix of the student's "
                         f"{b''.join(student)[:60]!r}: they cannot be aligned")
    s_off, t_off = _offsets(student), _offsets(teacher)
    boundaries = sorted(set(s_off) & set(t_off))
    spans, i, j = [], 0, 0
    for end in boundaries[1:]:
        i0, j0 = i, j
        while i < len(student) and s_off[i] < end:  # the tokens that start before the boundary end by it
            i += 1
        while j < len(teacher) and t_off[j] < end:
            j += 1
        spans.append(AlignedSpan(i0, i, j0, j))
    if i < len(student):
        spans.append(AlignedSpan(i, len(student), j, j))
    return spans


@dataclass(frozen=True)
class CrossTokens:
    """A student's action as a teacher of another tokenizer reads it: the teacher's ids of its text
    and the spans aligning them with the student's ids."""

    teacher_ids: list[int]
    spans: list[AlignedSpan]


def cross_tokens(student_tokenizer: Any, teacher_tokenizer: Any, student_ids: Sequence[int]) -> CrossTokens:
    """The student's action `student_ids` in the teacher's tokenizer: its text (whole characters,
    special tokens left out) encoded on its own, and the aligned spans. A tokenizer that does not
    give back the bytes it encoded (one that normalizes text) is refused, naming the text."""
    pieces = token_bytes(student_tokenizer, student_ids)
    text = valid_text(b"".join(pieces))
    teacher_ids = list(teacher_tokenizer.encode(text, add_special_tokens=False))
    teacher_pieces = token_bytes(teacher_tokenizer, teacher_ids)
    if b"".join(teacher_pieces) != text.encode("utf-8"):
        raise ValueError(f"the teacher's tokenizer ({getattr(teacher_tokenizer, 'name_or_path', '?')}) reads "
                         f"{text[:60]!r} back as {b''.join(teacher_pieces)[:60]!r}: its tokens do not hold the "
                         "text's bytes, so the student's and teacher's tokens cannot be aligned")
    return CrossTokens(teacher_ids, aligned_spans(pieces, teacher_pieces))


def spread_teacher_logprobs(spans: Sequence[AlignedSpan], teacher_logprobs: Sequence[float],
                            sampling_logprobs: Sequence[float]) -> list[float]:
    """T'_p for every student token p (module docstring): T'_p = s_old_p + (T_span - S_span) / n over
    each span of n student tokens with teacher tokens, s_old_p on a tail span. teacher_logprobs [m]
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
