"""Micro-batches packed by token count: which sequences go together, and their padded tensors.

Sequences are sorted by length (longest first) and filled greedily into right-padded
[rows, max_len] blocks with rows * max_len <= the token budget, so neighbours have similar lengths
and padding stays small. A sequence longer than the budget gets a block of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnopd.core.types import TokenBatch


def pack_by_tokens(seq_lens: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into micro-batches whose padded size rows * max_len <= max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])  # stable: ties keep batch order
    groups: list[list[int]] = []
    for i in order:
        # lengths only decrease along `order`, so a group's padded length is its first sequence's
        if groups and (len(groups[-1]) + 1) * seq_lens[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded sequences of one micro-batch.

    scored[r, p] marks the action tokens whose log-prob is trained (the hidden state at p - 1
    predicts token p); action_index gives, for each scored token in row-major order, its index
    among the batch's action tokens (the order of `batch.loss_mask.nonzero()`).
    """

    input_ids: torch.Tensor  # [rows, max_len]
    scored: torch.Tensor  # [rows, max_len] bool
    action_index: torch.Tensor  # [n_scored]
    num_tokens: int  # real (non-padding) tokens
    num_padding: int
    image_keys: tuple[str, ...] = ()  # the rows' screenshots, row by row in placeholder order (a VLM student)
    teacher: str | None = None  # the env whose in-process teacher reads the rows (None: the run's one teacher)


def build_micro_batch(batch: TokenBatch, seq_indices: list[int], pad_id: int = 0) -> MicroBatch:
    """The padded tensors of the sequences `seq_indices` of `batch` (see `pack_by_tokens`)."""
    slices = batch.sequences()
    action_of_position = torch.cumsum(batch.loss_mask.long(), 0) - 1
    rows = [slices[i] for i in seq_indices]
    max_len = max(s.stop - s.start for s in rows)
    input_ids = torch.full((len(rows), max_len), pad_id, dtype=torch.long)
    scored = torch.zeros((len(rows), max_len), dtype=torch.bool)
    action_index = []
    for r, s in enumerate(rows):
        n = s.stop - s.start
        input_ids[r, :n] = batch.input_ids[s]
        scored[r, :n] = batch.loss_mask[s]
        action_index.append(action_of_position[s][batch.loss_mask[s]])
    if scored[:, 0].any():
        raise ValueError("a sequence starts with an action token: its log-prob has no context to be "
                         "predicted from (every sequence must begin with prompt tokens)")
    num_tokens = sum(s.stop - s.start for s in rows)
    image_keys = tuple(key for i in seq_indices for key in batch.image_keys[i]) if batch.image_keys else ()
    return MicroBatch(input_ids, scored, torch.cat(action_index), num_tokens, len(rows) * max_len - num_tokens,
                      image_keys)


def padding_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A two-token micro-batch with one scored token, run (with zero loss) by a rank that has fewer
    micro-batches than another, so that every rank joins the same collectives."""
    return MicroBatch(torch.full((1, 2), pad_id, dtype=torch.long), torch.tensor([[False, True]]),
                      torch.zeros(0, dtype=torch.long), 0, 2)
