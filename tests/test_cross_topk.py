"""The teacher's top-k across vocabularies (estimator topk_cross, objective.tokenizers=cross): the
vocabulary map on real tokenizers (the tests' tiny byte-level BPE, SmolLM2-135M's), the top-k carried
to each span's first student token, the loss on a 3-token toy worked out by hand (exact KL on the
shared tokens + ULD on the rest), gradients reaching the student only, and with identical
tokenizers the same loss and gradients as the same-vocabulary `topk` (the function, and a trainer
step through scoring)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import make_env_spec
from teachers import TeacherSpec, make_teacher, score_trajectories
from tests.test_token_alignment import play
from tests.trainer.helpers import configs
from turnopd.algorithm.objective import gather_logprobs, masked_topk_logprobs, topk_cross_loss, topk_loss
from turnopd.algorithm.token_alignment import span_first_topk, vocab_map
from turnopd.config import EnvConfig
from turnopd.core.types import AlignedSpan, Trajectory, build_token_batch
from turnopd.rollout.render import renderer_for


def test_the_vocab_map_pairs_the_texts_both_vocabularies_hold(tiny, smol):
    pairs = vocab_map(tiny, smol)
    assert vocab_map(tiny, smol) is pairs  # once per pair of tokenizers
    s, t = tiny.convert_tokens_to_ids, smol.convert_tokens_to_ids
    # of the teacher's 49,152 ids, 349 have a student token of their bytes; 37 of the student's 386 have none
    assert (len(tiny), len(smol)) == (386, 49152)
    assert int((pairs.student_of_teacher >= 0).sum()) == 349 and int(pairs.student_only.sum()) == 37
    for piece in ("Ġa", "Ã", "1", "Ġ"):  # a word, a byte of é, a digit, the space: the same bytes on both sides
        assert int(pairs.student_of_teacher[t(piece)]) == s(piece)
    assert int(pairs.student_of_teacher[t("<|im_end|>")]) == s("<|im_end|>")  # special tokens by their string
    for piece in ("put", "ĠðŁĺ"):  # the student spells "put" p + ut, the emoji's bytes in 4 tokens
        assert s(piece) is None and int(pairs.student_of_teacher[t(piece)]) == -1
    # SmolLM2 splits digits ("Ġ", "1") and has no <action> token
    only = {tiny.convert_ids_to_tokens(i) for i in pairs.student_only.nonzero().flatten().tolist()}
    assert {"Ġ1", "Ġ2", "<action>", "</action>", "<think>", "</think>"} <= only and "Ġa" not in only
    # an id past the teacher's tokenizer (a padding row of its head) has no student id; a student head's
    # rows past its tokenizer are left out of the rest
    assert pairs.student_ids(torch.tensor([[t("Ġa"), 49152 + 3]])).tolist() == [[s("Ġa"), -1]]
    assert pairs.rest_mask(390)[386:].tolist() == [False] * 4


def test_the_teacher_s_top_k_is_kept_at_each_span_s_first_student_token():
    spans = [AlignedSpan(0, 2, 0, 1), AlignedSpan(2, 3, 1, 3), AlignedSpan(3, 4, 3, 3)]  # the last: no teacher token
    ids, logprobs = span_first_topk(spans, [[5, 6], [7, 8], [9, 1]], [[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0]])
    assert ids == [[5, 6], [], [7, 8], []]  # the teacher's row 2 predicts inside its span: no student token
    assert logprobs == [[-0.1, -2.0], [], [-0.2, -3.0], []]


def toy() -> dict[str, torch.Tensor]:
    """Student vocabulary a b c d with probabilities .4 .4 .15 .05 (logits log p through a 1-d head); the
    teacher's top-3 a .5, b .3 and x .2 (x: a text the student's vocabulary lacks; c, d: texts the
    teacher's lacks). Row 2: a token inside a span (no top-k), s = -1, T' = -1.5."""
    hidden = torch.ones(2, 1, requires_grad=True)
    head = torch.log(torch.tensor([[0.4], [0.4], [0.15], [0.05]])).requires_grad_()
    ids = torch.tensor([[0, 1, -1], [0, 0, 0]])
    teacher_topk = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)], [-math.inf] * 3], requires_grad=True)
    keep = torch.tensor([False, False, True, True])
    student = torch.tensor([-1.0, -1.0]).requires_grad_()
    return {"hidden": hidden, "head": head, "ids": ids, "teacher_topk": teacher_topk, "keep": keep,
            "student": student, "teacher": torch.tensor([0.0, -1.5], requires_grad=True)}


def toy_loss(x: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    student_topk = gather_logprobs(x["hidden"], x["head"], x["ids"].clamp(min=0), chunk_size=1)
    rest = masked_topk_logprobs(x["hidden"], x["head"], x["keep"], 3, chunk_size=1)
    return topk_cross_loss(x["student"], x["teacher"], student_topk, x["teacher_topk"], x["ids"], rest, kind)


@pytest.mark.parametrize("kind, shared", [
    # buckets a, b, tail: student .4 .4 .2, teacher .5 .3 .2 (x's .2 in its tail)
    ("reverse", 0.4 * math.log(0.4 / 0.5) + 0.4 * math.log(0.4 / 0.3)),  # 0.0258154
    ("forward", 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)),  # 0.0252672
])
def test_the_loss_on_a_three_token_toy_by_hand(kind, shared):
    x = toy()
    loss = toy_loss(x, kind)
    # ULD: the rest sorted, teacher (.2, 0, 0) (x), student (.15, .05, 0) (c, d): |.15 - .2| + |.05 - 0| + 0
    uld = 0.1
    # row 2, no top-k: k3 on the span's share, exp(T' - s) - (T' - s) - 1
    k3 = math.exp(-0.5) + 0.5 - 1.0
    assert loss.tolist() == pytest.approx([shared + uld, k3], abs=1e-6)
    loss.sum().backward()
    assert x["hidden"].grad.abs().sum() > 0 and x["head"].grad.abs().sum() > 0 and x["student"].grad[1] != 0
    assert x["teacher_topk"].grad is None and x["teacher"].grad is None  # the teacher's side is a target
    assert x["student"].grad[0] == 0  # a row with the top-k reads no sampled-token log-prob


def test_the_uld_gradient_pulls_the_student_s_rest_toward_the_teacher_s():
    x = toy()
    rest = masked_topk_logprobs(x["hidden"][:1], x["head"], x["keep"], 3)
    assert rest.exp()[0].tolist() == pytest.approx([0.15, 0.05, 0.0])
    (rest.exp() - torch.tensor([[0.2, 0.0, 0.0]])).abs().sum().backward()
    # dULD/dp = g = (0, 0, -1, +1) (c below the teacher's .2, d above its 0); through the softmax,
    # d logit_v = p_v (g_v - sum_u p_u g_u) = p_v (g_v + .1): a .04, b .04, c -.135, d .055
    assert x["head"].grad.flatten().tolist() == pytest.approx([0.04, 0.04, -0.135, 0.055], abs=1e-6)


@pytest.mark.parametrize("kind", ["reverse", "forward", "jsd"])
def test_with_one_vocabulary_it_is_topk(kind):
    torch.manual_seed(0)
    hidden, head = torch.randn(5, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    ids = torch.stack([torch.randperm(30)[:4] for _ in range(5)])
    teacher_topk = torch.log_softmax(torch.randn(5, 30), -1).gather(1, ids).sort(-1, descending=True).values
    losses, grads = [], []
    for cross in (False, True):
        h, w = hidden.detach().clone().requires_grad_(), head.detach().clone().requires_grad_()
        student_topk = gather_logprobs(h, w, ids)
        if cross:  # every id paired with itself, none unpaired
            rest = masked_topk_logprobs(h, w, torch.zeros(30, dtype=torch.bool), 4)
            loss = topk_cross_loss(torch.zeros(5), torch.zeros(5), student_topk, teacher_topk, ids, rest, kind)
        else:
            loss = topk_loss(student_topk, teacher_topk, kind)
        loss.sum().backward()
        losses.append(loss.detach())
        grads.append(torch.cat([h.grad.flatten(), w.grad.flatten()]))
    assert torch.equal(losses[0], losses[1]) and torch.allclose(grads[0], grads[1], rtol=0, atol=1e-7)


def test_with_identical_tokenizers_a_trainer_step_is_topk_s(tiny, tiny_model_dir):
    """Scored by the tiny teacher, once on the student's own tokens (topk) and once through the cross
    path with a second copy of its tokenizer (topk_cross): the same loss, gradient norm and weights."""
    from turnopd.trainer import Trainer

    spec = make_env_spec(EnvConfig(name="alfworld", template="default", answer_format="action"))
    teacher = make_teacher(TeacherSpec(name="tiny", model=str(tiny_model_dir), dtype="float32", max_length=1024))
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    twin = AutoTokenizer.from_pretrained(tiny_model_dir)
    results, params = [], []
    for estimator, view in (("topk", renderer_for(spec, tiny)), ("topk_cross", renderer_for(spec, tiny,
                                                                                              teacher_tokenizer=twin))):
        turns = play(view, tiny, ["<action>go to desk 1</action>", "<think>I look.</think><action>look</action>"])
        for turn in turns:
            turn.student_logprobs = [-0.7 - 0.1 * j for j in range(len(turn.action_ids))]
        trajectory = Trajectory("t", "alfworld", turns=turns)
        score_trajectories({"alfworld": teacher}, [trajectory], topk=4)
        batch = build_token_batch([trajectory])
        trainer = Trainer(copy.deepcopy(student), *configs(estimator, "progressive"), total_steps=2,
                          vocab_map=vocab_map(tiny, twin))
        results.append(trainer.step(batch, alpha=0.5))
        params.append(torch.cat([p.detach().flatten() for p in trainer.module.parameters()]))
    assert int(vocab_map(tiny, twin).student_only.sum()) == 0
    assert results[1].loss == pytest.approx(results[0].loss, rel=1e-6)
    assert results[1].grad_norm == pytest.approx(results[0].grad_norm, rel=1e-6)
    assert torch.allclose(params[1], params[0], rtol=0, atol=1e-7)
