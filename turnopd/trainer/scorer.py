"""The trainer's student forward: the estimator's per-token loss at the action tokens only.

The module DeepSpeed wraps is this scorer (the HF model is its `model`): its forward runs the
decoder to hidden states, keeps the positions that predict action tokens (hidden at p - 1 predicts
token p) and reads log-probs out through the output embedding in chunks (`gather_logprobs`), so a
whole-batch [N, V] log-softmax never exists. Running the head inside the engine's forward is also
what ZeRO-3 needs: the head weight is registered as an external parameter of this module and is
gathered for its forward and backward.

Rows that begin with the same tokens (a system prompt, GRPO's group of one task) run that shared
prefix once (`decode`): a decoder's states at a position depend only on the tokens up to it, so the
prefix's states and keys/values are the same in every row, computed for one and repeated; gradients
from every row flow back into that one pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from turnopd.algorithm.familiarity import entropy_from_logprobs, mask_spans, span_signals
from turnopd.algorithm.objective import (
    Estimator,
    TokenInputs,
    gather_logprobs,
    masked_topk_logprobs,
    policy_gradient_loss,
)


def check_causal_lm(model: nn.Module, role: str) -> None:
    """Fail early, with the reason, on a model whose logits are not `decoder(x) @ head.T`."""
    missing = [name for name in ("get_decoder", "get_output_embeddings") if not hasattr(model, name)]
    if missing:
        raise TypeError(f"the {role} must be a Hugging Face causal LM (missing {', '.join(missing)}), "
                        f"got {type(model).__name__}")
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError(f"the {role} ({type(model).__name__}) needs an output embedding without bias")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"the {role} ({type(model).__name__}) soft-caps its logits, which the chunked "
                         "log-prob readout does not apply")


# below this many shared tokens the second decoder call (and the cached-attention mask) costs more than
# the prefix it saves
MIN_SHARED_PREFIX = 16


def shared_prefix_length(input_ids: torch.Tensor) -> int:
    """How many leading tokens every row of `input_ids` [rows, L] has in common, at most L - 1 (the
    rows keep one position of their own); 0 for a single row."""
    rows, length = input_ids.shape
    if rows < 2:
        return 0
    differs = (input_ids != input_ids[:1]).any(0).nonzero()
    return min(int(differs[0]) if len(differs) else length, length - 1)


def decode(model: nn.Module, input_ids: torch.Tensor, share_prefix: bool,
           pixel_values: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's last hidden states [rows, L, d] of right-padded `input_ids` [rows, L].

    With `pixel_values` [images, C, H, W] (a vision-language student: the images of the rows' image
    positions, row by row), the multimodal model runs: its vision tower's features fill the image
    positions before the decoder, whole rows (a prefix holding images is not shared).

    With `share_prefix`, a prefix of P >= MIN_SHARED_PREFIX tokens common to all rows runs once on one
    row, its keys/values repeated for the rows' own tokens: (rows - 1) * P fewer token positions in
    the forward and backward, and the same states up to float rounding. Not under activation
    checkpointing, which keeps no key/value cache."""
    if pixel_values is not None:
        return model.model(input_ids=input_ids, pixel_values=pixel_values, use_cache=False).last_hidden_state
    decoder = model.get_decoder()
    prefix = shared_prefix_length(input_ids) if share_prefix and not model.is_gradient_checkpointing else 0
    if prefix < MIN_SHARED_PREFIX:
        return decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    rows = input_ids.shape[0]
    shared = decoder(input_ids=input_ids[:1, :prefix], use_cache=True)
    cache = shared.past_key_values
    cache.batch_repeat_interleave(rows)  # differentiable: every row's gradient reaches the one pass
    own = decoder(input_ids=input_ids[:, prefix:], past_key_values=cache, use_cache=True).last_hidden_state
    return torch.cat([shared.last_hidden_state.expand(rows, -1, -1), own], 1)


def select_predicting(hidden: torch.Tensor, input_ids: torch.Tensor, scored: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [n, d] at the positions that predict the scored tokens, and those tokens' ids [n]
    (row-major order)."""
    predicting = scored[:, 1:]
    return hidden[:, :-1][predicting], input_ids[:, 1:][predicting]


@torch.no_grad()
def turn_signals(hidden: torch.Tensor, head: torch.Tensor, input_ids: torch.Tensor, scored: torch.Tensor,
                 chunk_size: int = 256) -> dict[str, torch.Tensor]:
    """The familiarity signals (turnopd.algorithm.familiarity.span_signals) of a model that ran
    in this process, from its hidden states [rows, L, d] and head [V, d]: per scored token (row-major,
    the order of `select_predicting`), its turn's value. The entropy is the whole distribution's."""
    out: dict[str, list[float]] = {"context_logprob": [], "action_logprob": [], "action_entropy": []}
    for row in range(input_ids.shape[0]):
        spans = mask_spans(scored[row].tolist())
        if not spans:
            continue
        end = spans[-1][1]
        logprobs = [0.0, *gather_logprobs(hidden[row, : end - 1], head, input_ids[row, 1:end], chunk_size).tolist()]
        entropies = [0.0] * end
        for start, stop in spans:  # the entropy at action positions only: a [tokens, V] softmax each
            logits = (hidden[row, start - 1 : stop - 1] @ head.T).float()
            entropies[start:stop] = entropy_from_logprobs(torch.log_softmax(logits, -1)).tolist()
        for (start, stop), signals in zip(spans, span_signals(logprobs, spans, entropies), strict=True):
            for name, value in signals.items():
                out[name] += [value] * (stop - start)
    return {name: torch.tensor(values, dtype=torch.float64) for name, values in out.items()}


class ActionScorer(nn.Module):
    def __init__(self, model: nn.Module, chunk_size: int = 256, share_prefix: bool = True):
        super().__init__()
        check_causal_lm(model, "student")
        self.model = model
        self.chunk_size = chunk_size
        self.share_prefix = share_prefix

    @property
    def head_weight(self) -> nn.Parameter:
        return self.model.get_output_embeddings().weight  # tied models: the input embedding itself

    def forward(self, input_ids: torch.Tensor, scored: torch.Tensor, estimator: Estimator, settings: Any,
                inputs: TokenInputs, pixel_values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`loss`: the per-token loss l_p of `estimator` at the scored tokens of right-padded `input_ids`
        [rows, L] (no attention mask needed: a real token attends only to earlier positions, all real).

        `inputs` holds what the batch brings (sampling and teacher log-probs, the teacher's top-k,
        or the teacher's hidden states [n, d] and head [V, d]; for topk_cross the student ids no teacher id
        is paired with, whose k largest log-probs this forward reads out too) and the proximal log-probs when the
        trainer computed them before its first update; this forward adds the student's side
        the estimator needs: the log-probs of the tokens (and of the teacher's top-k ids at the same
        positions), read out through the head in chunks, or the hidden states and head for a
        full-vocabulary estimator. Running it inside the engine's forward is what ZeRO-3 needs.
        `kl`: the per-token KL the metrics report, the full-vocabulary divergence itself, else the
        sampled-token estimate s - T. With an `inputs.advantage`, `loss` is l_p + reward_weight * g_p,
        g_p the reward term's `policy_gradient_loss` (its ratio against the sampling log-prob, under
        objective.clip_eps and dual_clip). `pixel_values`: the images of a vision-language student's
        image positions (see `decode`).
        """
        hidden = decode(self.model, input_ids, self.share_prefix, pixel_values)
        hidden, token_ids = select_predicting(hidden, input_ids, scored)
        if estimator.needs_teacher_model:
            # the student's head cut to the teacher's rows (the shared tokenizer's vocabulary, Trainer.vocab)
            inputs = dataclasses.replace(inputs, student_hidden=hidden,
                                         student_head=self.head_weight[: inputs.teacher_head.shape[0]])
            loss = estimator.token_loss(inputs, settings)
            return {"loss": loss, "kl": loss}
        topk_ids = inputs.teacher_topk_ids if estimator.needs_teacher_topk else None
        # an id of -1 (topk_cross: a teacher's text the student's vocabulary lacks) reads row 0, unused
        ids = token_ids[:, None] if topk_ids is None else torch.cat([token_ids[:, None], topk_ids.clamp(min=0)], 1)
        logprobs = gather_logprobs(hidden, self.head_weight, ids, self.chunk_size)
        inputs = dataclasses.replace(inputs, student=logprobs[:, 0],
                                     student_topk=logprobs[:, 1:] if topk_ids is not None else None)
        if estimator.needs_vocab_map:  # the student's most likely ids among those no teacher id is paired with
            inputs = dataclasses.replace(inputs, student_rest=masked_topk_logprobs(
                hidden, self.head_weight, inputs.student_rest_mask, topk_ids.shape[1], self.chunk_size))
        if estimator.needs_proximal_logprobs and inputs.proximal is None:
            # none given: the step is one update, so this forward runs the weights the step started
            # from, the proximal policy's (no second pass)
            inputs = dataclasses.replace(inputs, proximal=logprobs[:, 0].detach())
        loss = estimator.token_loss(inputs, settings)
        if inputs.advantage is not None:
            loss = loss + settings.reward_weight * policy_gradient_loss(
                inputs.student, inputs.sampling, inputs.advantage, settings.clip_eps, settings.dual_clip)
        return {"loss": loss, "kl": inputs.student - inputs.teacher}
