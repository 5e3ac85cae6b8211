"""The trainer's student forward: log-probs of the action tokens only.

The module DeepSpeed wraps is this scorer (the HF model is its `model`): its forward runs the
decoder to hidden states, keeps the positions that predict action tokens (hidden at p - 1 predicts
token p) and reads log-probs out through the output embedding in chunks (`gather_logprobs`), so a
whole-batch [N, V] log-softmax never exists. Running the head inside the engine's forward is also
what ZeRO-3 needs: the head weight is registered as an external parameter of this module and is
gathered for its forward and backward.
"""

from __future__ import annotations

import torch
from torch import nn

from turnopd.objective import full_vocab_loss, gather_logprobs


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


def select_predicting(hidden: torch.Tensor, input_ids: torch.Tensor, scored: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [n, d] at the positions that predict the scored tokens, and those tokens' ids [n]
    (row-major order)."""
    predicting = scored[:, 1:]
    return hidden[:, :-1][predicting], input_ids[:, 1:][predicting]


class ActionScorer(nn.Module):
    def __init__(self, model: nn.Module, chunk_size: int = 256):
        super().__init__()
        check_causal_lm(model, "student")
        self.model = model
        self.chunk_size = chunk_size

    @property
    def head_weight(self) -> nn.Parameter:
        return self.model.get_output_embeddings().weight  # tied models: the input embedding itself

    def forward(self, input_ids: torch.Tensor, scored: torch.Tensor, extra_ids: torch.Tensor | None = None,
                teacher_hidden: torch.Tensor | None = None, teacher_head: torch.Tensor | None = None,
                kind: str = "reverse", beta: float = 0.5) -> dict[str, torch.Tensor]:
        """For the scored tokens of right-padded `input_ids` [rows, L] (no attention mask needed: a
        real token attends only to earlier positions, all real):

        - without a teacher: `logprobs` [n] of the tokens themselves, and with `extra_ids` [n, k]
          `extra_logprobs` [n, k] of those ids at the same positions (e.g. the teacher's top-k);
        - with `teacher_hidden` [n, d] and `teacher_head` [V, d]: `divergence` [n], the full-vocabulary
          divergence of the student from the teacher (`full_vocab_loss`).
        """
        hidden = self.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        hidden, token_ids = select_predicting(hidden, input_ids, scored)
        if teacher_hidden is not None:
            return {"divergence": full_vocab_loss(hidden, self.head_weight, teacher_hidden, teacher_head,
                                                  kind, beta, self.chunk_size)}
        ids = token_ids[:, None] if extra_ids is None else torch.cat([token_ids[:, None], extra_ids], 1)
        logprobs = gather_logprobs(hidden, self.head_weight, ids, self.chunk_size)
        out = {"logprobs": logprobs[:, 0]}
        if extra_ids is not None:
            out["extra_logprobs"] = logprobs[:, 1:]
        return out
