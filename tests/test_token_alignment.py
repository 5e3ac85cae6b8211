"""Cross-tokenizer teachers (objective.tokenizers=cross, turnopd.algorithm.token_alignment): the
student's action aligned with a teacher's tokenization of its text, on real tokenizers (the tests'
tiny byte-level BPE, SmolLM2-135M's), every span written out by hand from the two tokenizations; the
teacher's log-probs spread over the student's tokens and each sampled-token estimator on them, by
hand; the rendering of the teacher's own view of a turn; and, with two identical tokenizers, the
cross-tokenizer path giving the same-tokenizer path's teacher log-probs, loss and parameters."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import make_env_spec
from envs.base import PromptContext
from teachers import TeacherSpec, make_teacher, score_trajectories
from tests.trainer.helpers import configs
from turnopd.algorithm.objective import k1_decoupled_loss, k1_loss, k1_proximal_loss, k3_loss
from turnopd.algorithm.token_alignment import (
    aligned_spans,
    cross_tokens,
    piece_bytes,
    spread_teacher_logprobs,
    token_bytes,
)
from turnopd.config import EnvConfig, PromptConfig, RecipeError
from turnopd.core.types import AlignedSpan, Trajectory, Turn, build_token_batch, trajectory_sequences
from turnopd.rollout.render import TeacherTokens, chat_prompt_ids, renderer_for


def align(student_tok, teacher_tok, text: str, cut: int | None = None):
    """The student's ids of `text` (its first `cut`), their CrossTokens, and the spans as (student
    tokens, teacher tokens), as the vocabularies spell them."""
    ids = student_tok.encode(text, add_special_tokens=False)[:cut]
    cross = cross_tokens(student_tok, teacher_tok, ids)
    s, t = student_tok.convert_ids_to_tokens(ids), teacher_tok.convert_ids_to_tokens(cross.teacher_ids)
    return ids, cross, [(s[a.student_start:a.student_end], t[a.teacher_start:a.teacher_end]) for a in cross.spans]


def test_pieces_are_read_as_their_bytes():
    assert piece_bytes("Ġto") == b" to"  # byte-level BPE: Ġ is the space byte
    assert piece_bytes("Ã©") == "é".encode()  # é = C3 A9, each byte its own character
    assert piece_bytes("ðŁĺ") == "😀".encode()[:3]  # F0 9F 98: part of a character
    assert piece_bytes("<0xE2>") == b"\xe2"  # a SentencePiece byte fallback
    assert piece_bytes("▁café") == " café".encode()  # SentencePiece's word marker


def test_multi_byte_characters_align_on_bytes(tiny, smol):
    _, cross, pairs = align(tiny, smol, "café 😀 naïve")
    # é is 2 byte tokens for the tiny BPE and one for SmolLM2; the emoji's 4 bytes F0 9F 98 80 split
    # [space F0 9F 98][80] by both, so a span boundary falls inside the character
    assert pairs == [
        (["c"], ["c"]), (["a", "f"], ["af"]), (["Ã", "©"], ["Ã©"]), (["Ġ", "ð", "Ł", "ĺ"], ["ĠðŁĺ"]), (["Ģ"], ["Ģ"]),
        (["Ġn", "a"], ["Ġna"]), (["Ã", "¯", "ve"], ["Ã¯ve"])]
    assert cross.spans[3] == AlignedSpan(5, 9, 3, 4)


def test_a_word_split_differently_is_one_span(tiny, smol):
    _, _, pairs = align(tiny, smol, "put a mug in coffeemachine 1")
    assert pairs == [
        (["p", "ut"], ["put"]), (["Ġa"], ["Ġa"]), (["Ġm"], ["Ġm"]), (["u", "g"], ["ug"]), (["Ġin"], ["Ġin"]),
        (["Ġc", "o", "f", "f"], ["Ġcoff"]), (["ee", "m"], ["eem"]), (["a", "c", "h", "in", "e"], ["achine"]),
        (["Ġ1"], ["Ġ", "1"])]


def test_an_action_cut_by_the_token_limit_inside_a_character_ends_in_a_tail_span(tiny, smol):
    ids, cross, pairs = align(tiny, smol, "café 😀", cut=8)  # max_new_tokens=8: the emoji's first 2 bytes
    assert tiny.convert_ids_to_tokens(ids)[-2:] == ["ð", "Ł"]
    assert smol.decode(cross.teacher_ids) == "café "  # the teacher reads the whole characters
    assert pairs == [
        (["c"], ["c"]), (["a", "f"], ["af"]), (["Ã", "©"], ["Ã©"]), (["Ġ"], ["Ġ"]), (["ð", "Ł"], [])]


def test_a_sampled_end_of_turn_token_has_no_text_and_is_in_the_tail(tiny, smol):
    ids = [*tiny.encode("<action>go to desk 1</action>", add_special_tokens=False), tiny.eos_token_id]
    cross = cross_tokens(tiny, smol, ids)
    assert smol.convert_ids_to_tokens(cross.teacher_ids) == ["<", "action", ">", "go", "Ġto", "Ġdesk", "Ġ", "1",
                                                              "</", "action", ">"]
    # the tiny BPE holds <action> whole: one student token, three teacher tokens
    assert cross.spans == [AlignedSpan(0, 1, 0, 3), AlignedSpan(1, 2, 3, 4), AlignedSpan(2, 3, 4, 5),
                           AlignedSpan(3, 4, 5, 6), AlignedSpan(4, 5, 6, 8), AlignedSpan(5, 6, 8, 11),
                           AlignedSpan(6, 7, 11, 11)]
    # an answer of its end-of-turn token alone: no text for the teacher, one tail span, log-ratio 0
    alone = cross_tokens(tiny, smol, [tiny.eos_token_id])
    assert alone.teacher_ids == [] and alone.spans == [AlignedSpan(0, 1, 0, 0)]
    assert spread_teacher_logprobs(alone.spans, [], [-0.25]) == [-0.25]


def test_a_tool_call_turn_aligns_span_by_span(tiny, smol):
    ids, cross, _ = align(tiny, smol, '<tool_call>{"name": "act", "arguments": {"action": "go to desk 1"}}</tool_call>')
    texts = [(b"".join(token_bytes(tiny, ids[s.student_start:s.student_end])).decode(),
              b"".join(token_bytes(smol, cross.teacher_ids[s.teacher_start:s.teacher_end])).decode())
             for s in cross.spans]
    assert all(a == b for a, b in texts)
    assert [a for a, _ in texts] == ["<", "tool", "_", "call", ">", '{"', "name", '":', ' "', "act", '",', ' "',
                                     "arguments", '":', ' {"', "action", '":', ' "', "go", " to", " desk", " 1", '"',
                                     "}}", "</", "tool", "_", "call", ">"]
    assert cross.spans[1] == AlignedSpan(1, 5, 1, 2)  # t, o, o, l | tool


def test_bytes_one_side_does_not_hold_leave_their_student_tokens_without_teacher_tokens():
    # the teacher's tokenizer drops the control byte 16 (SmolLM2's does): "go t\x16o" is read "go to"
    # equal blocks "go t" and "o": boundaries (0, 0), (2, 2), then (6, 5) in the second block
    assert aligned_spans([b"go", b" t", b"\x16", b"o"], [b"go", b" to"]) == [
        AlignedSpan(0, 1, 0, 1), AlignedSpan(1, 4, 1, 1)]
    # a gap inside: "go" | "\xff" (no character) | " to" on the student's side; the spans resume after it
    assert aligned_spans([b"go", b"\xff", b" to"], [b"go", b" to"]) == [
        AlignedSpan(0, 1, 0, 1), AlignedSpan(1, 2, 1, 1), AlignedSpan(2, 3, 1, 2)]


def test_a_byte_the_teacher_s_tokenizer_drops_is_a_gap_in_a_real_action(tiny, smol):
    ids, cross, pairs = align(tiny, smol, "<action>go\x16 to desk 1</action>")
    assert smol.decode(cross.teacher_ids) == "<action>go to desk 1</action>"
    # Ė: the byte-level BPE's character for byte 0x16, one student token with no teacher token
    assert pairs == [(["<action>"], ["<", "action", ">"]), (["go"], ["go"]), (["Ė"], []),
                     (["Ġto"], ["Ġto"]), (["Ġdesk"], ["Ġdesk"]), (["Ġ1"], ["Ġ", "1"]),
                     (["</action>"], ["</", "action", ">"])]


# A span of one token, one of two tokens split 1:1 differently, and an end-of-turn token with no text:
# student  "go" | " t" "o" | <eos>      s_old = -0.5 | -1.0 -0.2 | -2.0
# teacher  "go" | " to"                 T     = -0.3 | -0.9
SPANS = aligned_spans([b"go", b" t", b"o", b""], [b"go", b" to"])
SAMPLING = [-0.5, -1.0, -0.2, -2.0]
TEACHER = [-0.3, -0.9]
# T'_p = s_old_p + (T_span - S_span) / n: span 1 -0.5 + 0.2; span 2 shares (-0.9 + 1.2) / 2 = 0.15; the tail s_old
SPREAD = [-0.3, -0.85, -0.05, -2.0]


def test_the_teacher_s_span_log_prob_is_shared_equally_over_the_student_s_tokens():
    assert [AlignedSpan(0, 1, 0, 1), AlignedSpan(1, 3, 1, 2), AlignedSpan(3, 4, 2, 2)] == SPANS  # <eos>: the tail
    assert spread_teacher_logprobs(SPANS, TEACHER, SAMPLING) == pytest.approx(SPREAD)
    assert sum(SPREAD[1:3]) == pytest.approx(TEACHER[1])  # the span's sum is the teacher's log-prob of " to"
    # a token without text inside the answer joins the span starting where it stands: a third of 2.3 each
    inside = aligned_spans([b"go", b" t", b"", b"o"], [b"go", b" to"])
    assert inside == [AlignedSpan(0, 1, 0, 1), AlignedSpan(1, 4, 1, 2)]
    assert spread_teacher_logprobs(inside, TEACHER, [-0.5, -1.0, -2.0, -0.2]) == pytest.approx(
        [-0.3, -1.0 + 2.3 / 3, -2.0 + 2.3 / 3, -0.2 + 2.3 / 3])


@pytest.mark.parametrize("estimator", ["k1", "k1_proximal", "k1_decoupled", "k3"])
def test_each_sampled_token_estimator_on_aligned_spans(estimator):
    """On-policy (s = s_old = s_prox): each token's log-ratio T' - s is its span's share d = 0.2, 0.15,
    0.15, 0 (the tail); k1 and its variants take l = -d (gradient -d per token: a span's sum is minus
    the span's log-ratio), k3 l = e^d - d - 1 (gradient -(e^d - 1))."""
    s = torch.tensor(SAMPLING, dtype=torch.float64, requires_grad=True)
    old, teacher = torch.tensor(SAMPLING, dtype=torch.float64), torch.tensor(SPREAD, dtype=torch.float64)
    loss = {"k1": lambda: k1_loss(s, old, teacher), "k1_proximal": lambda: k1_proximal_loss(s, teacher),
            "k1_decoupled": lambda: k1_decoupled_loss(s, s.detach(), old, teacher), "k3": lambda: k3_loss(s, teacher)
            }[estimator]()
    loss.sum().backward()
    shares = [0.2, 0.15, 0.15, 0.0]
    if estimator == "k3":
        assert loss.tolist() == pytest.approx([math.exp(d) - d - 1 for d in shares])  # 0.0214028, 0.0118342 x2, 0
        assert s.grad.tolist() == pytest.approx([-(math.exp(d) - 1) for d in shares])
    else:
        assert loss.tolist() == pytest.approx([-d for d in shares])
        assert s.grad.tolist() == pytest.approx([-d for d in shares])
    assert float(loss[1:3].detach().sum()) == pytest.approx(
        {"k3": 2 * (math.exp(0.15) - 1.15)}.get(estimator, -(TEACHER[1] - sum(SAMPLING[1:3]))))


# --- the teacher's view of a turn -------------------------------------------------------------


def context(step: int, observation: str) -> PromptContext:
    return PromptContext(task="put a pencil on desk 2.", step=step, observation=observation, history=[],
                         admissible=["go to desk 1", "look"], answer_format="action")


def play(view, student_tok, actions: list[str]) -> list[Turn]:
    """Turns whose policy answered `actions`, as the agent loop makes them (finish_turn included)."""
    turns: list[Turn] = []
    for step, action in enumerate(actions):
        shown = view.render(context(step, f"You see desk {step + 1}."), [], turns)
        ids = student_tok.encode(action, add_special_tokens=False)
        turns.append(view.finish_turn(Turn(index=step, observation="", prompt_ids=shown.ids, action_ids=ids,
                                           student_logprobs=[-1.0] * len(ids), teacher_prompt_ids=shown.teacher_ids)))
    return turns


ACTIONS = ["<action>go to desk 1</action>", "<action>look</action>"]


def test_history_block_the_teacher_reads_the_env_s_message_in_its_own_template(tiny, smol):
    spec = make_env_spec(EnvConfig(name="alfworld", template="default", answer_format="action"))
    view = renderer_for(spec, tiny, teacher_tokenizer=smol)
    assert isinstance(view, TeacherTokens)
    turns = play(view, tiny, ACTIONS)
    for step, turn in enumerate(turns):
        message = spec.render_prompt(context(step, f"You see desk {step + 1}."))
        assert turn.prompt_ids == chat_prompt_ids(tiny, message)
        assert turn.teacher_prompt_ids == chat_prompt_ids(smol, message)
        assert turn.teacher_action_ids == smol.encode(ACTIONS[step], add_special_tokens=False)
    sequences = trajectory_sequences(Trajectory("t", "alfworld", turns=turns), "teacher")
    assert [seq.ids for seq in sequences] == [t.teacher_prompt_ids + t.teacher_action_ids for t in turns]


def test_chat_the_teacher_reads_the_conversation_in_its_own_template(tiny, smol):
    spec = make_env_spec(EnvConfig(name="alfworld", template="default", answer_format="action"))
    chat = PromptConfig(style="chat")
    view = renderer_for(spec, tiny, prompt=chat, teacher_tokenizer=smol)
    turns = play(view, tiny, ACTIONS)
    messages = [{"role": "user", "content": spec.render_prompt(context(0, "You see desk 1."))},
                {"role": "assistant", "content": ACTIONS[0]},
                {"role": "user", "content": "You see desk 2.\nAdmissible actions: 'go to desk 1', 'look'"}]
    for tok, ids in ((smol, turns[1].teacher_prompt_ids), (tiny, turns[1].prompt_ids)):
        assert ids == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
    sequences = trajectory_sequences(Trajectory("t", "alfworld", turns=turns), "teacher")
    assert len(sequences) == 1  # one conversation, one pass of the teacher, in its tokens
    assert sequences[0].ids[-len(turns[1].teacher_action_ids):] == turns[1].teacher_action_ids


def test_cross_with_a_vision_language_student_is_refused(tiny, smol):
    spec = make_env_spec(EnvConfig(name="webshop_screenshot"))
    with pytest.raises(RecipeError, match="objective.tokenizers"):
        renderer_for(spec, tiny, image_tokens=4, teacher_tokenizer=smol)


# --- identical tokenizers: the cross path is the same-tokenizer path -----------------------------


def test_with_identical_tokenizers_the_cross_path_gives_the_same_loss_and_gradients(tiny, tiny_model_dir):
    from turnopd.trainer import Trainer

    spec = make_env_spec(EnvConfig(name="alfworld", template="default", answer_format="action"))
    teacher = make_teacher(TeacherSpec(name="tiny", model=str(tiny_model_dir), dtype="float32", max_length=1024))
    student = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    batches = []
    for view in (renderer_for(spec, tiny), renderer_for(spec, tiny, teacher_tokenizer=AutoTokenizer.from_pretrained(
            tiny_model_dir))):
        turns = play(view, tiny, ["<action>go to desk 1</action>", "<think>I look.</think><action>look</action>"])
        for turn in turns:  # as sampled: its own log-probs, so the spread reads real ones
            turn.student_logprobs = [-0.7 - 0.1 * j for j in range(len(turn.action_ids))]
        trajectory = Trajectory("t", "alfworld", turns=turns)
        score_trajectories({"alfworld": teacher}, [trajectory])
        batches.append(build_token_batch([trajectory]))
    assert all(span.student_end - span.student_start == 1 == span.teacher_end - span.teacher_start
               for span in turns[0].token_spans)
    same, cross = batches
    assert torch.equal(cross.input_ids, same.input_ids) and torch.equal(cross.loss_mask, same.loss_mask)
    assert torch.allclose(cross.teacher_logprobs, same.teacher_logprobs, rtol=0, atol=1e-6)
    results, params = [], []
    for batch in batches:
        trainer = Trainer(copy.deepcopy(student), *configs("k1", "progressive"), total_steps=2)
        results.append(trainer.step(batch, alpha=0.5))
        params.append(torch.cat([p.detach().flatten() for p in trainer.module.parameters()]))
    assert results[1].loss == pytest.approx(results[0].loss, rel=1e-6)
    assert results[1].grad_norm == pytest.approx(results[0].grad_norm, rel=1e-6)
    assert torch.allclose(params[1], params[0], rtol=0, atol=1e-7)


def test_spans_cover_every_student_token_once_and_hold_equal_bytes_when_matched():
    """Random texts cut at random places into tokens on each side, the teacher's side with random bytes
    dropped: the spans are consecutive over the student's tokens, and a span with teacher tokens
    holds the same bytes on both sides, each teacher token in one such span at most."""
    import random

    rng = random.Random(0)

    def cut(data: bytes) -> list[bytes]:
        marks = sorted(rng.sample(range(1, len(data)), rng.randint(0, len(data) - 1))) if len(data) > 1 else []
        return [data[a:b] for a, b in zip([0, *marks], [*marks, len(data)], strict=True)]

    for _ in range(300):
        text = bytes(rng.choice(b"ab \xc3\xa9\x16") for _ in range(rng.randint(1, 12)))
        student = cut(text)
        if rng.random() < 0.3:
            student.insert(rng.randint(0, len(student)), b"")  # a special token
        teacher = cut(bytes(b for b in text if rng.random() > 0.1) or b"a")
        spans = aligned_spans(student, teacher)
        assert [s.student_start for s in spans] == [0, *[s.student_end for s in spans[:-1]]]
        assert spans[-1].student_end == len(student)
        read = 0  # each teacher token in one span at most, in order
        for s in spans:
            if s.teacher_end > s.teacher_start:
                assert s.teacher_start >= read
                read = s.teacher_end
                assert b"".join(student[s.student_start:s.student_end]) == b"".join(
                    teacher[s.teacher_start:s.teacher_end])


def test_the_audit_refuses_a_teacher_of_another_tokenizer():
    from pathlib import Path

    from turnopd.orchestration.audit import check_audit_setup
    from turnopd.orchestration.recipe import load_recipe

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    cfg = load_recipe(recipe, ["objective.estimator=k1", "objective.tokenizers=cross"])
    with pytest.raises(RecipeError, match="cross is not built for `turnopd audit`"):
        check_audit_setup(cfg)
