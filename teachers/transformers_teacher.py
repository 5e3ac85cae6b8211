"""The `transformers` teacher: a local Hugging Face model scoring sequences with batched forward passes.

It exposes `.model` (the nn.Module) and `.tokenizer`, so the trainer's `full` estimator can run the
teacher in its own process. With spec.adapter (a LoRA adapter folder), the adapter is loaded on the
base and merged into its weights (`PeftModel.from_pretrained(base, adapter).merge_and_unload()`): a
fixed teacher scores as fast as the base, and `.model` is a plain model. spec.options:
`max_batch_tokens` (padded tokens per forward pass, default 2048 on a CPU and 16384 on a GPU, see
GPU_MAX_BATCH_TOKENS), `device` (default: the run's, turnopd.core.device).

A vision-language teacher (`reads_screenshots`) scores what the student saw, screenshots included:
its `screens` (turnopd.loaders.screens.ScreenPixels, set by the run's start-up) fetch each batch's
pixels from the pixel store.
"""

from __future__ import annotations

import torch

from teachers.base import TEACHER_BACKENDS, Teacher, TokenScores, check_sequences
from teachers.spec import TeacherSpec, check_adapter
from turnopd.algorithm.familiarity import entropy_from_logprobs
from turnopd.core.device import run_device
from turnopd.loaders.hf_models import image_tokens_of, length_batches, load_model, model_max_length
from turnopd.loaders.screens import ScreenPixels

# Padded tokens per forward pass (spec.options.max_batch_tokens unset). A pass's logits take
# max_batch_tokens x vocab floats (2048 x 49k SmolLM2 logits: 0.4 GB in fp32), the bound on a CPU.
# On a GPU a pass of 2048 tokens of a small model is a few milliseconds of kernel launches that leave
# the chip mostly idle, and a step's episodes became many such tiny forwards; 16384 tokens keep it
# busy while the logits stay a few GB (16384 x 49k in bf16: 1.6 GB; a 152k vocabulary in fp32: 10 GB).
CPU_MAX_BATCH_TOKENS = 2048
GPU_MAX_BATCH_TOKENS = 16384


@TEACHER_BACKENDS.register("transformers")
class TransformersTeacher(Teacher):
    provides_model = True  # `.model` is the nn.Module, in this process
    scores_entropy = True  # the whole distribution is at hand

    @staticmethod
    def max_topk(spec: TeacherSpec) -> int | None:
        return None  # any k up to the vocabulary

    def __init__(self, spec: TeacherSpec):
        self.name = spec.name
        adapter = check_adapter(spec)  # before the base loads: a bad adapter fails at once
        self.device = torch.device(spec.options.get("device") or run_device())
        self.model, self.tokenizer = load_model(spec.model, spec.dtype, adapter=spec.adapter if adapter else None,
                                                device=self.device)
        if adapter is not None:
            self.model = self.model.merge_and_unload().eval()
        self.model.requires_grad_(False)
        self.max_length = min(spec.max_length, model_max_length(self.model, self.tokenizer))
        self.model_dir = spec.model
        self.reads_screenshots = image_tokens_of(self.model.config) > 0
        self.screens: ScreenPixels | None = None
        default_tokens = GPU_MAX_BATCH_TOKENS if self.device.type == "cuda" else CPU_MAX_BATCH_TOKENS
        self.max_batch_tokens = int(spec.options.get("max_batch_tokens", default_tokens))

    @torch.inference_mode()
    def score(self, sequences: list[list[int]], topk: int = 0,
              image_keys: list[list[str]] | None = None) -> list[TokenScores]:
        """`image_keys`: per sequence, the screenshots of its image positions (a vision-language teacher)."""
        check_sequences(sequences, self.max_length, self.name)
        out: list[TokenScores | None] = [None] * len(sequences)
        for batch in length_batches([len(s) for s in sequences], max_batch_tokens=self.max_batch_tokens):
            width = len(sequences[batch[0]])
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):  # right padding: positions are the same as unpadded
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, : len(sequences[i])] = 1
            keys = [key for i in batch for key in (image_keys[i] if image_keys else [])]
            images = {"pixel_values": self.screens(keys).to(self.device, self.model.dtype)} if keys else {}
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **images).logits
            for row, i in enumerate(batch):
                n = len(sequences[i])
                # logits at p-1 predict token p
                logprobs = logits[row, : n - 1].float().log_softmax(-1)
                targets = ids[row, 1:n].to(logprobs.device)
                token_lp = [0.0, *logprobs.gather(1, targets[:, None]).squeeze(1).tolist()]
                scores = TokenScores(logprobs=token_lp, entropy=[0.0, *entropy_from_logprobs(logprobs).tolist()])
                if topk:
                    top = logprobs.topk(topk, dim=-1)
                    scores.topk_ids = [[], *top.indices.tolist()]
                    scores.topk_logprobs = [[], *top.values.tolist()]
                out[i] = scores
        return out  # type: ignore[return-value]

    def close(self) -> None:
        pass
