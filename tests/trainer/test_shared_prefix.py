"""Rows that begin alike run their common prefix once (turnopd.trainer.scorer.decode): the same
states, gradients and step as running every row whole, with fewer token positions."""

import copy
import random

import pytest
import torch

from tests.trainer.helpers import VOCAB, configs, reference_loss, tiny_llama
from turnopd.core.types import Trajectory, Turn, build_token_batch
from turnopd.trainer import Trainer
from turnopd.trainer.scorer import MIN_SHARED_PREFIX, decode, shared_prefix_length

PREFIX = [(7 * i + 3) % VOCAB for i in range(20)]  # a 20-token "system prompt" every episode starts with


@pytest.mark.parametrize(("rows", "expected"), [
    ([[5, 6, 7, 8], [5, 6, 9, 8]], 2),  # the third token differs
    ([[5, 6, 7, 8], [4, 6, 7, 8]], 0),  # the first does
    ([[1, 2, 3], [1, 2, 3], [1, 2, 3]], 2),  # all alike: the rows keep their last position
    ([[1, 2, 3, 0], [1, 2, 3, 4], [1, 2, 9, 9]], 2),  # the common prefix of all rows, not of a pair
    ([[1, 2, 3]], 0),  # one row shares with nobody
])
def test_shared_prefix_length_by_hand(rows, expected):
    assert shared_prefix_length(torch.tensor(rows)) == expected


def prefixed_trajectories(seed: int, count: int, max_turns: int = 3) -> list[Trajectory]:
    """Appending trajectories of random tokens whose first prompt begins with PREFIX."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        history, turns = PREFIX, []
        for t in range(rng.randint(1, max_turns)):
            prompt = history + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
            action = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
            turns.append(Turn(index=t, observation="", prompt_ids=prompt, action_ids=action,
                              student_logprobs=[-rng.uniform(0.1, 5.0) for _ in action],
                              teacher_logprobs=[-rng.uniform(0.1, 5.0) for _ in action]))
            history = prompt + action
        out.append(Trajectory(task_id=f"t{i}", env_name="synthetic", turns=turns))
    return out


def decoder_calls(model) -> list[tuple[int, int]]:
    """The [rows, positions] shape of every call of the model's decoder, from now on."""
    shapes: list[tuple[int, int]] = []
    model.get_decoder().register_forward_hook(lambda _m, args, kwargs, _out: shapes.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return shapes


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_decode_gives_the_states_and_gradients_of_whole_rows(attention):
    torch.manual_seed(0)
    ids = torch.cat([torch.tensor([PREFIX] * 3), torch.randint(0, VOCAB, (3, 9))], 1)  # [3, 29]: 20 shared
    probe = torch.randn(3, 29, 32)
    results = []
    for share in (False, True):
        model = tiny_llama(0)
        model.config._attn_implementation = attention
        calls = decoder_calls(model)
        hidden = decode(model, ids, share)
        (hidden * probe).sum().backward()
        results.append((hidden.detach(), {n: p.grad for n, p in model.named_parameters()}, calls))
    (whole, grads_whole, calls_whole), (shared, grads_shared, calls_shared) = results
    assert calls_whole == [(3, 29)]
    assert calls_shared == [(1, 20), (3, 9)]  # the prefix once, then each row's own 9 tokens
    torch.testing.assert_close(shared, whole, rtol=1e-5, atol=1e-5)
    for name, grad in grads_whole.items():  # float32 rounding of sums in another order: ~1e-6 of the largest
        assert float((grads_shared[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()), name


def test_a_short_common_prefix_runs_the_rows_whole():
    ids = torch.cat([torch.tensor([PREFIX[: MIN_SHARED_PREFIX - 1]] * 2), torch.tensor([[1, 2], [3, 4]])], 1)
    model = tiny_llama(0)
    calls = decoder_calls(model)
    decode(model, ids, share_prefix=True)
    assert calls == [(2, MIN_SHARED_PREFIX + 1)]


@pytest.mark.parametrize(("estimator", "zero_stage"), [("k1", 0), ("full", 0), ("full", 3)])
def test_a_step_on_prefixed_rows_equals_the_reference_and_the_unshared_step(estimator, zero_stage):
    trajectories = prefixed_trajectories(seed=1, count=5)
    teacher = tiny_llama(seed=1) if estimator == "full" else None
    expected = reference_loss(tiny_llama(0), trajectories, estimator, "token_mean", alpha=0.0, teacher=teacher)
    out = []
    for share in (True, False):
        student = tiny_llama(0)
        calls = decoder_calls(student)
        trainer = Trainer(student, *configs(estimator, "token_mean", zero_stage=zero_stage, shared_prefix=share),
                          total_steps=2, teacher_model=copy.deepcopy(teacher))
        metrics = trainer.step(build_token_batch(trajectories), alpha=0.0)
        with trainer.gathered_parameters() as model:
            out.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}, calls))
    (shared, p_shared, calls_shared), (whole, p_whole, calls_whole) = out
    assert metrics.num_micro_batches == 1
    assert calls_shared[0] == (1, len(PREFIX)) and len(calls_shared) == 2
    assert len(calls_whole) == 1
    assert shared.loss == pytest.approx(expected.item(), rel=1e-5)
    assert whole.loss == pytest.approx(expected.item(), rel=1e-5)
    assert shared.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    for name, value in p_whole.items():
        torch.testing.assert_close(p_shared[name], value, rtol=0, atol=5e-4, msg=name)
