"""The `transformers` policy backend: batched `model.generate` with left padding and a KV cache.

Construct with `make_policy(policy_config, model, tokenizer=..., dtype=...)` (backend `transformers`):
`model` is a Hugging Face directory, or an already-loaded `nn.Module` (the trainer's student) with
its tokenizer, in which case generation runs on that very module and a weight sync of the same
module is free.

Stored log-probs: for each generated token, log softmax of the model's RAW logits (temperature 1,
no top-p), i.e. the sampling log-prob exactly when temperature == 1 and top_p == 1, and otherwise the
log-prob under the model's own distribution (what the trainer recomputes). The vLLM backend stores
the same quantity (`logprobs_mode="raw_logprobs"`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from turnopd.config import PolicyConfig
from turnopd.loaders.hf_models import image_tokens_of, load_model, model_max_length
from turnopd.loaders.lora import load_sync_state, sync_state
from turnopd.rollout.base import POLICY_BACKENDS, Generation, Policy, SamplingParams
from turnopd.rollout.batching import DEFAULT_WAIT_S, MicroBatcher
from turnopd.rollout.completion import check_prompt_lengths, eos_token_ids, finish_completion


class RowSampler:
    """A logits processor that samples each row from its own random stream: row r's next token is
    drawn from softmax(logits_r / T) over its top-p set by the Gumbel-max trick,
    argmax_v(logits_rv / T + g_rv) with g_rv = -log(-log u_rv), u_rv ~ U(0, 1) from row r's
    generator (seeded by the request), which is a draw from that distribution. generate then takes
    the argmax (do_sample=False), so a row's tokens do not depend on the rows batched with it.

    The generators live on `device`, the model's: on a GPU the noise is drawn there (no per-token
    CPU draw and copy over). A seed gives other numbers on a GPU than on the CPU (another
    generator), the same ones on every run of one device type."""

    def __init__(self, seeds: list[int | None], temperature: float, top_p: float,
                 device: str | torch.device = "cpu"):
        self.generators = [torch.Generator(device=device).manual_seed(
            seed if seed is not None else int(torch.randint(2**62, (1,)))) for seed in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.temperature
        if self.top_p < 1.0:
            scores = top_p_filter(scores, self.top_p)
        u = torch.stack([torch.rand(scores.shape[1], generator=g, device=g.device) for g in self.generators])
        return scores - torch.log(-torch.log(u.clamp(min=1e-20)))


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Scores outside each row's nucleus set to -inf: the most likely tokens whose probabilities sum
    to at least top_p (transformers' TopPLogitsWarper: at least one token kept)."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[..., -1:] = False
    return scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))


class _StopStrings:
    """Ends a row once its generated text (not the prompt) contains a stop string, by the same test
    as `finish_completion`, so that generation stops exactly where the completion is cut (vLLM also
    matches stop strings in the generated text only)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], prompt_width: int):
        self.tokenizer, self.stop, self.prompt_width = tokenizer, stop, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width :], skip_special_tokens=True)
        return torch.tensor([any(s in text for s in self.stop) for text in texts], device=input_ids.device)


@POLICY_BACKENDS.register("transformers")
class TransformersPolicy(Policy):
    """Student generation with Hugging Face transformers (CPU or one GPU: a model loaded here goes
    to the run's device, turnopd.core.device; a loaded module generates where it is).

    config.options: `max_model_len` (default: the model's position limit), `batch_wait_s` (how
    long a batch may wait for the requests of other active episodes, default 0.05 s; see
    turnopd.rollout.batching).

    A vision-language student (a config with a vision tower) reads screenshots: `image_tokens` is
    the number of prompt positions one image fills, and `screens` (set by whoever holds the pixel
    store, turnopd.orchestration.startup) turns a batch's screenshot keys into its pixel_values when
    the batch is built, so that only keys wait in the queue.
    """

    def __init__(self, model: str | os.PathLike[str] | nn.Module, config: PolicyConfig, *,
                 tokenizer: Any = None, dtype: str = "auto", seed: int = 0):
        if isinstance(model, nn.Module):
            if tokenizer is None:
                raise ValueError("the transformers policy needs the tokenizer of an already-loaded model")
            self.model = model
        else:
            self.model, loaded_tokenizer = load_model(model, dtype)
            tokenizer = tokenizer or loaded_tokenizer
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = int(config.options.get("max_model_len") or model_max_length(self.model, tokenizer))
        self.eos_ids = eos_token_ids(tokenizer, self.model.config)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.pad_id = int(pad)
        self.seed = seed
        self.weight_version = 0
        self.image_tokens = image_tokens_of(self.model.config)
        self.screens: Callable[[list[str]], torch.Tensor] | None = None
        # rows of similar length batched together: every row is padded to its batch's longest
        # (64 WebShop prompts of 145-1944 tokens: 1.8x faster than batches in arrival order,
        # benchmarks/generation_batching.py)
        self._batcher = MicroBatcher(self._generate_rows, max_rows=config.max_batch_size,
                                     wait_s=float(config.options.get("batch_wait_s", DEFAULT_WAIT_S)))

    @property
    def before_batch(self):
        return self._batcher.before_batch

    @before_batch.setter
    def before_batch(self, hook):
        self._batcher.before_batch = hook

    async def generate(self, prompt: list[int], sampling: SamplingParams, image_keys: Sequence[str] = ()) -> Generation:
        check_prompt_lengths([prompt], sampling.max_new_tokens, self.max_model_len)
        if image_keys and (not self.image_tokens or self.screens is None):
            raise ValueError("a prompt with screenshots needs a vision-language student and a pixel store "
                             f"(image_tokens {self.image_tokens}, screens {'set' if self.screens else 'unset'})")
        return await self._batcher.submit(prompt, sampling, image_keys)

    def session(self):
        return self._batcher.session()

    def _generate_rows(self, rows: list[list[int]], samplings: list[SamplingParams],
                       image_keys: list[list[str]]) -> list[Generation]:
        """One `model.generate` call over rows of equal sampling settings (their seeds aside)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate_batch(rows, samplings, image_keys)
        finally:
            self.model.train(was_training)

    @torch.inference_mode()
    def _generate_batch(self, rows: list[list[int]], samplings: list[SamplingParams],
                        image_keys: list[list[str]]) -> list[Generation]:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        sampling = samplings[0]
        device = next(self.model.parameters()).device
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: every row's last prompt token is at the end
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
        # Sampling is the row sampler's (a random stream per row); generate itself picks the argmax.
        # Every processor set to neutral explicitly: unset fields would take the model's defaults
        # (e.g. top_k=50), and the sampling distribution would silently differ from vLLM's.
        gen_config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
            min_length=0, typical_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0,
            eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id,
            return_dict_in_generate=True, output_logits=True,
            # a VLM never writes its image token: in an answer it would be taken for an image position
            suppress_tokens=[self.model.config.image_token_id] if self.image_tokens else None,
        )
        sampler = [] if sampling.temperature == 0 else [RowSampler([s.seed for s in samplings], sampling.temperature,
                                                                    sampling.top_p, device)]
        stopping = StoppingCriteriaList([_StopStrings(self.tokenizer, sampling.stop, width)] if sampling.stop else [])
        # a VLM fills the image positions row by row, placeholder by placeholder: the keys in that order
        keys = [key for row_keys in image_keys for key in row_keys]
        images = {"pixel_values": self.screens(keys).to(device, self.model.dtype)} if keys else {}
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                  generation_config=gen_config, logits_processor=LogitsProcessorList(sampler),
                                  stopping_criteria=stopping, **images)
        new_tokens = out.sequences[:, width:]
        # out.logits: one [rows, vocab] tensor per step, before any processor (the row sampler);
        # gathered on the model's device and copied over once, not once per step
        logprobs = torch.stack([
            step_logits.float().log_softmax(-1).gather(1, new_tokens[:, j : j + 1]).squeeze(1)
            for j, step_logits in enumerate(out.logits)
        ], dim=1).cpu()
        new_tokens = new_tokens.cpu()
        return [
            finish_completion(new_tokens[i].tolist(), logprobs[i].tolist(), self.tokenizer, sampling.stop, self.eos_ids)
            for i in range(len(rows))
        ]

    def update_weights(self, model: nn.Module | dict[str, torch.Tensor]) -> None:
        """New student weights: the generating module itself (nothing to copy), another module or what
        `turnopd.loaders.lora.sync_state` returns (a LoRA student's adapter only), copied in once no
        batch is running."""
        with self._batcher.lock:
            if model is not self.model:
                load_sync_state(self.model, sync_state(model) if isinstance(model, nn.Module) else model)
            self.weight_version += 1

    def close(self) -> None:
        """Nothing to release: the model is freed with the policy."""
