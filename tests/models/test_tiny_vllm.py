"""vLLM loads a tiny model's directory as transformers does (run in the vLLM venv)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_vllm_scores_tiny_model_like_transformers(tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "Your task is to: put some pencil on desk."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    ids = prompt + tok.encode("<action>go to desk 1</action>", add_special_tokens=False)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    expected = [logp[p - 1, ids[p]].item() for p in range(1, len(ids))]

    llm = LLM(model=str(tiny_model_dir), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    assert got == pytest.approx(expected, abs=1e-4)
    # vLLM's tokenizer is the same one: the chat template renders identically.
    vllm_tok = llm.get_tokenizer()
    assert vllm_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
