"""The transformers policy backend on a tiny local model: log-probs, batching, stop strings, seeded
samples that do not depend on their batch, weight sync. Expected values come from plain forward
passes of the same model."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from turnopd.config import PolicyConfig
from turnopd.loaders.hf_models import length_batches
from turnopd.rollout import POLICY_BACKENDS, SamplingParams
from turnopd.rollout.base import generate_all, request_seed
from turnopd.rollout.completion import PromptTooLongError, finish_completion
from turnopd.rollout.render import chat_prompt_ids
from turnopd.rollout.transformers_backend import RowSampler, top_p_filter

MESSAGES = ["You arrive at desk 1.", "Your task is to: put some pencil on desk. You see a bed 1 and a drawer 2.",
            "Nothing happens.", "You pick up the pencil 1 from the desk 1."]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return POLICY_BACKENDS.get("transformers")(tiny_model_dir, PolicyConfig(max_batch_size=8), dtype="float32")


@pytest.fixture(scope="module")
def prompts(policy):
    return [chat_prompt_ids(policy.tokenizer, m) for m in MESSAGES]


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[j] | prompt + completion[:j]) from one unpadded forward pass at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    lp = logits.log_softmax(-1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by repeated full forward passes (no cache, no padding)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_prompts_have_different_lengths(prompts):
    assert len({len(p) for p in prompts}) == len(prompts)  # so left padding is exercised


def test_greedy_batched_matches_unbatched_reference(policy, prompts):
    out = generate_all(policy, prompts, SamplingParams(temperature=0.0, max_new_tokens=12, stop=()))
    assert policy._batcher.batch_sizes[-1] == len(prompts)  # requested together: one batch
    for prompt, gen in zip(prompts, out, strict=True):
        reference = greedy_reference(policy.model, prompt, 12)
        eos = policy.tokenizer.eos_token_id
        expected = reference[: reference.index(eos) + 1] if eos in reference else reference
        assert gen.token_ids == expected
        assert gen.finish_reason == ("stop" if eos in reference else "length")
        assert gen.logprobs == pytest.approx(forward_logprobs(policy.model, prompt, gen.token_ids), abs=1e-4)
        assert gen.text == policy.tokenizer.decode(gen.token_ids, skip_special_tokens=True)


def test_sampled_logprobs_are_raw_model_logprobs(policy, prompts):
    """Stored log-probs are under the raw distribution at any temperature / top-p (the trainer's)."""
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        out = generate_all(policy, prompts * 2, SamplingParams(temperature=temperature, top_p=top_p,
                                                               max_new_tokens=10, stop=(), seed=3))
        for prompt, gen in zip(prompts * 2, out, strict=True):
            assert gen.logprobs == pytest.approx(forward_logprobs(policy.model, prompt, gen.token_ids), abs=1e-4)


def test_a_seeded_sample_does_not_depend_on_its_batch(policy, prompts):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, stop=(), seed=11)
    together = generate_all(policy, prompts * 3, sampling)  # 12 requests, each its own seed
    assert all(1 <= len(g.token_ids) <= 8 for g in together)
    assert [g.token_ids for g in generate_all(policy, prompts * 3, sampling)] == [g.token_ids for g in together]
    # request 5 alone, and in batches of 5 rows, samples exactly what it sampled among 12
    alone = asyncio.run(policy.generate(prompts[1], dataclasses.replace(sampling, seed=request_seed(11, 5))))
    assert alone.token_ids == together[5].token_ids
    small = POLICY_BACKENDS.get("transformers")(policy.model, PolicyConfig(max_batch_size=5), tokenizer=policy.tokenizer)
    chunked = generate_all(small, prompts * 3, sampling)
    assert small._batcher.batch_sizes == [5, 5, 2]
    assert [g.token_ids for g in chunked] == [g.token_ids for g in together]
    # samples of one prompt with other seeds differ (3 draws of 8 tokens from a random model)
    assert len({tuple(together[i].token_ids) for i in (0, 4, 8)}) == 3


def test_row_sampler_draws_from_the_softmax():
    """Gumbel-max per row: over 4000 draws of a 4-token distribution the frequencies are the softmax
    probabilities (0.1, 0.2, 0.3, 0.4) within 3 standard errors; top-p 0.5 keeps {0.4, 0.3} only."""
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    draws = torch.tensor([int(RowSampler([seed], 1.0, 1.0)(None, logits).argmax()) for seed in range(4000)])
    freq = torch.bincount(draws, minlength=4).double() / 4000
    for f, p in zip(freq.tolist(), [0.1, 0.2, 0.3, 0.4], strict=True):
        assert abs(f - p) < 3 * (p * (1 - p) / 4000) ** 0.5
    kept = top_p_filter(logits, 0.5)  # sorted 0.4, 0.3 (cumulative 0.7 >= 0.5): 0.1 and 0.2 dropped
    assert torch.isinf(kept[0, :2]).all() and torch.isfinite(kept[0, 2:]).all()
    draws = {int(RowSampler([seed], 1.0, 0.5)(None, logits).argmax()) for seed in range(200)}
    assert draws == {2, 3}


def test_row_sampler_draws_on_its_device_from_each_requests_stream():
    """The generators live on the device given (the model's); on the CPU each row's noise is the
    plain CPU stream of its seed, -log(-log u) with u = torch.rand(vocab) seeded by the request."""
    sampler = RowSampler([5, 6], 1.0, 1.0, device="cpu")
    assert [g.device for g in sampler.generators] == [torch.device("cpu")] * 2
    noise = sampler(None, torch.zeros(2, 50))
    expected = torch.stack([-torch.log(-torch.log(torch.rand(50, generator=torch.Generator().manual_seed(seed))))
                            for seed in (5, 6)])
    torch.testing.assert_close(noise, expected, rtol=0, atol=0)


def test_length_batches_group_rows_of_similar_length():
    lengths = [5, 30, 7, 28, 6, 29]
    # by rows: longest first (30, 29, 28 | 7, 6, 5): each batch pads to its own longest
    assert length_batches(lengths, max_rows=3) == [[1, 5, 3], [2, 4, 0]]
    # by padded tokens (rows x longest <= 64): 30 and 29 pad to 2 x 30 = 60; adding 28 would make 90, so
    # 28 starts a batch that 7 joins (2 x 28 = 56); adding 6 would make 84, so 6 and 5 make the last one
    assert length_batches(lengths, max_batch_tokens=64) == [[1, 5], [3, 2], [4, 0]]
    assert length_batches([100, 3], max_batch_tokens=64) == [[0], [1]]  # too long for the budget: alone
    assert length_batches(lengths, max_batch_tokens=64, max_rows=1) == [[1], [5], [3], [2], [4], [0]]
    assert length_batches([4, 4, 4], max_rows=2) == [[0, 1], [2]]  # ties keep their order


def test_stop_string_cuts_after_its_tokens(policy, prompts):
    free = generate_all(policy, prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=16, stop=()))[0]
    text = free.text
    assert len(text) >= 6, text
    stop = text[3:6]  # a stop string in the middle of the greedy answer
    cut = generate_all(policy, prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=16, stop=(stop,)))[0]
    # expected: the shortest prefix of the free answer whose text contains the stop string
    k = next(k for k in range(1, len(free.token_ids) + 1)
             if stop in policy.tokenizer.decode(free.token_ids[:k], skip_special_tokens=True))
    assert cut.token_ids == free.token_ids[:k]
    assert cut.logprobs == pytest.approx(free.logprobs[:k])
    assert stop in cut.text and cut.finish_reason == "stop"


def test_finish_completion_rules(policy):
    tok = policy.tokenizer
    eos = tok.eos_token_id
    ids = tok("<action>go to desk 1</action> trailing", add_special_tokens=False)["input_ids"]
    gen = finish_completion(ids + [eos, 5, 6], [-0.5] * (len(ids) + 3), tok, ("</action>",), {eos})
    assert gen.text == "<action>go to desk 1</action>" and gen.finish_reason == "stop"
    assert len(gen.token_ids) == len(gen.logprobs) < len(ids)
    gen = finish_completion(ids + [eos, 5], [-0.5] * (len(ids) + 2), tok, (), {eos})
    assert gen.token_ids == ids + [eos] and gen.finish_reason == "stop"
    gen = finish_completion(ids, [-0.5] * len(ids), tok, ("nowhere",), {eos})
    assert gen.token_ids == ids and gen.finish_reason == "length"


def test_prompt_too_long_fails_before_generating(policy):
    too_long = [5] * (policy.max_model_len - 3)
    with pytest.raises(PromptTooLongError, match=r"prompt 0 has .* max length"):
        asyncio.run(policy.generate(too_long, SamplingParams(max_new_tokens=4)))


def test_weight_sync_same_module_and_state_dict(tiny_model_dir, prompts):
    own = POLICY_BACKENDS.get("transformers")(tiny_model_dir, PolicyConfig(), dtype="float32")
    other = POLICY_BACKENDS.get("transformers")(tiny_model_dir, PolicyConfig(), dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop=())
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.5)
    own.update_weights(other.model.state_dict())  # a copy
    assert own.weight_version == 1 and own.model is not other.model
    for prompt, gen in zip(prompts, generate_all(own, prompts, greedy), strict=True):
        assert gen.token_ids[:6] == greedy_reference(other.model, prompt, 6)[: len(gen.token_ids)]
        assert gen.logprobs == pytest.approx(forward_logprobs(other.model, prompt, gen.token_ids), abs=1e-4)
    same = POLICY_BACKENDS.get("transformers")(other.model, PolicyConfig(), tokenizer=other.tokenizer)
    same.update_weights(other.model)  # the trainer's own module: nothing to copy
    assert same.weight_version == 1 and same.model is other.model
    other.model.train()
    generate_all(same, prompts[:1], greedy)
    assert other.model.training  # generation ran in eval mode and gave the mode back
