"""Teacher familiarity: the signals on hand-worked examples and against a plain forward (scored by a
real transformers teacher, and by the teacher running inside the trainer), the weight and gate
controls on hand-worked weights, through the trainer, and the recipe checks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from teachers import TeacherSpec, make_teacher, score_trajectories
from teachers.base import Teacher, TokenScores
from tests.trainer.helpers import configs, random_trajectories, reference_loss, reference_weights
from turnopd.algorithm.familiarity import (
    entropy_from_logprobs,
    familiarity_factors,
    mask_spans,
    span_signals,
    topk_tail_entropy,
)
from turnopd.algorithm.objective import reweight
from turnopd.config import FamiliarityConfig, RecipeError
from turnopd.core.types import build_token_batch
from turnopd.trainer import Trainer

SIGMOID_1 = 1 / (1 + math.exp(-1))  # 0.7310585786


# ------------------------------------------------------------------------------------------------
# Pure functions, hand-worked
# ------------------------------------------------------------------------------------------------

def test_gate_and_weight_factors_and_the_renormalized_weights_by_hand():
    w = torch.tensor([0.25, 0.25, 0.5])
    x = torch.tensor([-1.0, -3.0, -1.0])  # context_logprob: higher is familiar; threshold -2
    gate = familiarity_factors(x, "gate", "context_logprob", -2.0)
    assert gate.tolist() == [1.0, 0.0, 1.0]
    # W = 1, W' = 0.75: the kept turns carry the step's whole weight
    assert reweight(w, gate, 1.0, 0.75).tolist() == pytest.approx([1 / 3, 0.0, 2 / 3])
    weight = familiarity_factors(x, "weight", "context_logprob", -2.0, temperature=1.0)
    assert weight.tolist() == pytest.approx([SIGMOID_1, 1 - SIGMOID_1, SIGMOID_1])
    # W' = 0.25 * 0.7310586 + 0.25 * 0.2689414 + 0.5 * 0.7310586 = 0.6155293; w' = w g / W'
    assert reweight(w, weight, 1.0, 0.6155293).tolist() == pytest.approx([0.2969227, 0.1092318, 0.5938455], rel=1e-5)
    # a temperature of 2 halves the slope: sigmoid(+-0.5)
    assert familiarity_factors(x, "weight", "context_logprob", -2.0, 2.0).tolist()[:2] == pytest.approx(
        [0.6224593, 0.3775407])
    # action_entropy: lower is familiar, so entropy 0.5 passes a threshold of 1.0 and 1.5 does not
    entropy = torch.tensor([0.5, 1.5, 1.0])
    assert familiarity_factors(entropy, "gate", "action_entropy", 1.0).tolist() == [1.0, 0.0, 1.0]
    assert familiarity_factors(entropy, "weight", "action_entropy", 1.0).tolist() == pytest.approx(
        [0.6224593, 0.3775407, 0.5])
    assert familiarity_factors(x, "none", "context_logprob", None).tolist() == [1.0, 1.0, 1.0]
    assert reweight(w, torch.zeros(3), 1.0, 0.0).tolist() == [0.0, 0.0, 0.0]  # every turn gated out


def test_factors_refuse_a_missing_threshold_or_signal():
    with pytest.raises(ValueError, match="needs a threshold"):
        familiarity_factors(torch.zeros(2), "gate", "context_logprob", None)
    with pytest.raises(ValueError, match="missing on some action tokens"):
        familiarity_factors(torch.tensor([0.0, math.nan]), "weight", "context_logprob", 0.0)


def test_entropies_by_hand():
    # top-2 of 0.5 and 0.25 and a tail bucket of 0.25: 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2
    assert topk_tail_entropy([math.log(0.5), math.log(0.25)]) == pytest.approx(1.5 * math.log(2))
    assert topk_tail_entropy([math.log(0.5), math.log(0.25), -math.inf]) == pytest.approx(1.5 * math.log(2))
    assert topk_tail_entropy([0.0]) == pytest.approx(0.0)  # all the mass on one token
    full = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]))
    assert entropy_from_logprobs(full).tolist() == pytest.approx([1.5 * math.log(2), 0.0])


def test_span_signals_and_mask_spans_by_hand():
    # positions 0..6: context 1-2, action 3-4 (turn 0), context 5, action 6 (turn 1)
    logprobs = [0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    entropies = [0.0, 9.0, 9.0, 0.2, 0.4, 9.0, 1.0]
    assert mask_spans([False, False, False, True, True, False, True]) == [(3, 5), (6, 7)]
    assert mask_spans([True, False]) == [(0, 1)]
    signals = span_signals(logprobs, [(3, 5), (6, 7)], entropies)
    assert signals == [pytest.approx({"context_logprob": -1.5, "action_logprob": -3.5, "action_entropy": 0.3}),
                       pytest.approx({"context_logprob": -5.0, "action_logprob": -6.0, "action_entropy": 1.0})]
    assert "action_entropy" not in span_signals(logprobs, [(3, 5)])[0]


def test_scoring_from_a_top_k_gives_the_tail_entropy():
    class TopkTeacher(Teacher):  # a teacher whose scores carry top-k and no entropy, as vLLM's (tested for real there)
        name, tokenizer, max_length = "topk", None, 100

        def score(self, sequences, topk=0):
            return [TokenScores(logprobs=[0.0, -1.0, -2.0], topk_ids=[[], [1, 2], [3, 4]],
                                topk_logprobs=[[], [-1.0, -2.0], [math.log(0.5), math.log(0.25)]]) for _ in sequences]

    trajectory = random_trajectories(0, 1, max_turns=1)[0]
    turn = trajectory.turns[0]
    turn.prompt_ids, turn.action_ids, turn.student_logprobs = [5, 6], [7], [-1.0]
    score_trajectories({"synthetic": TopkTeacher()}, [trajectory], topk=2)
    assert turn.teacher_signals == pytest.approx({"context_logprob": -1.0, "action_logprob": -2.0,
                                                  "action_entropy": 1.5 * math.log(2)})


# ------------------------------------------------------------------------------------------------
# The signals of a real teacher, scored and in the trainer, against a plain forward
# ------------------------------------------------------------------------------------------------

TRAJS = random_trajectories(3, 6, max_turns=4)


def reference_signals(model, trajectories) -> list[list[dict[str, float]]]:
    """Per trajectory and turn, the signals from a plain forward of the turn's prompt + action: the
    context is the prompt tokens after the previous action when the prompt extends it (position 0
    excluded), the whole prompt otherwise."""
    out = []
    for traj in trajectories:
        previous, per_turn = [], []
        for turn in traj.turns:
            ids = turn.prompt_ids + turn.action_ids
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
            token = [0.0] + [float(logp[p - 1, ids[p]]) for p in range(1, len(ids))]
            first = len(previous) if previous and turn.prompt_ids[: len(previous)] == previous else 1
            actions = range(len(turn.prompt_ids), len(ids))
            per_turn.append({
                "context_logprob": sum(token[first : len(turn.prompt_ids)]) / (len(turn.prompt_ids) - first),
                "action_logprob": sum(token[p] for p in actions) / len(actions),
                "action_entropy": sum(float(entropy_from_logprobs(logp[p - 1])) for p in actions) / len(actions)})
            previous = ids
        out.append(per_turn)
    return out


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir):
    return tiny_model_dir


def test_a_transformers_teacher_scores_the_signals_of_a_plain_forward(teacher_dir):
    teacher = make_teacher(TeacherSpec(name="tiny", model=str(teacher_dir), dtype="float32", max_length=512))
    trajectories = copy.deepcopy(TRAJS)
    score_trajectories({"synthetic": teacher}, trajectories)
    expected = reference_signals(teacher.model, TRAJS)
    for traj, want in zip(trajectories, expected, strict=True):
        assert [turn.teacher_signals for turn in traj.turns] == [pytest.approx(w, rel=1e-4, abs=1e-5) for w in want]


def test_the_in_process_teacher_gives_the_same_signals_from_its_own_forward(teacher_dir):
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    torch.manual_seed(5)
    student = LlamaForCausalLM(teacher.config).float()
    trainer = Trainer(student, *configs("full", "token_mean", micro_batch_tokens=40), total_steps=2,
                      teacher_model=copy.deepcopy(teacher))
    metrics = trainer.step(build_token_batch(TRAJS), alpha=0.0)
    assert metrics.num_micro_batches > 1
    expected = reference_signals(teacher, TRAJS)
    for name in ("context_logprob", "action_logprob", "action_entropy"):
        want = [[turn[name] for turn in traj] for traj in expected]
        assert metrics.turn_signals[name] == [pytest.approx(w, rel=1e-4, abs=1e-5) for w in want]
    assert metrics.familiarity_kept_share is None


def test_without_signals_the_in_process_teacher_trains_the_same_step(teacher_dir):
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    metrics = {}
    for signals in (True, False):
        torch.manual_seed(5)
        trainer = Trainer(LlamaForCausalLM(teacher.config).float(), *configs("full", "token_mean", micro_batch_tokens=40),
                          total_steps=2, teacher_model=copy.deepcopy(teacher),
                          familiarity_cfg=FamiliarityConfig(signals=signals))
        metrics[signals] = trainer.step(build_token_batch(TRAJS), alpha=0.0)
    assert metrics[False].turn_signals == {} and set(metrics[True].turn_signals) == {
        "context_logprob", "action_logprob", "action_entropy"}
    assert metrics[False].loss == metrics[True].loss and metrics[False].turn_kl == metrics[True].turn_kl


# ------------------------------------------------------------------------------------------------
# The controls through the trainer
# ------------------------------------------------------------------------------------------------

def with_signals(trajectories, signal: str, values: list[float]):
    """A copy whose turns (in order) carry the given signal values."""
    out = copy.deepcopy(trajectories)
    turns = [turn for traj in out for turn in traj.turns]
    assert len(turns) == len(values)
    for turn, value in zip(turns, values, strict=True):
        turn.teacher_signals = {signal: value}
    return out


def step_loss(trajectories, familiarity: FamiliarityConfig | None, mode: str = "progressive") -> dict:
    trainer = Trainer(LlamaForCausalLM(copy.deepcopy(STUDENT.config)).float(), *configs("k3", mode), total_steps=2,
                      familiarity_cfg=familiarity)
    trainer.module.load_state_dict(STUDENT.state_dict())
    return trainer.step(build_token_batch(trajectories), alpha=0.4)


STUDENT = None


@pytest.fixture(scope="module", autouse=True)
def _student():
    global STUDENT
    from tests.trainer.helpers import tiny_llama
    STUDENT = tiny_llama(0)


@pytest.mark.parametrize("mode", ["progressive", "trajectory", "turn", "token_mean"])
def test_gate_and_weight_train_the_hand_reweighted_loss(mode):
    turns = [turn for traj in TRAJS for turn in traj.turns]
    values = [-0.5 - (i % 4) for i in range(len(turns))]  # -0.5, -1.5, -2.5, -3.5, ...
    scored = with_signals(TRAJS, "context_logprob", values)
    base = torch.tensor(reference_weights(TRAJS, "progressive", 0.4) if mode == "progressive" else
                        reference_weights(TRAJS, "token_mean", 0.4) if mode == "token_mean" else
                        turn_mode_weights(mode))
    per_token = torch.tensor([v for turn, v in zip(turns, values, strict=True) for _ in turn.action_ids])
    for familiarity, factors in [
        (FamiliarityConfig(mode="gate", threshold=-2.0), (per_token >= -2.0).double()),
        (FamiliarityConfig(mode="weight", threshold=-2.0, temperature=0.5),
         torch.sigmoid((per_token.double() + 2.0) / 0.5))]:
        expected_w = base.double() * factors * base.double().sum() / (base.double() * factors).sum()
        expected = reference_loss(copy.deepcopy(STUDENT), TRAJS, "k3", "token_mean", 0.0, weights=expected_w.tolist())
        metrics = step_loss(scored, familiarity, mode)
        assert metrics.loss == pytest.approx(expected.item(), rel=1e-5)
        kept = float((base.double() * factors).sum() / base.double().sum())
        assert metrics.familiarity_kept_share == pytest.approx(kept, rel=1e-6)
        assert 0 < kept < 1


def turn_mode_weights(mode: str) -> list[float]:
    """trajectory: 1 / (N_traj n_i); turn: 1 / (N_traj T_i n_it), written out."""
    out = []
    for traj in TRAJS:
        for turn in traj.turns:
            n = traj.num_action_tokens if mode == "trajectory" else len(traj.turns) * len(turn.action_ids)
            out += [1.0 / (len(TRAJS) * n)] * len(turn.action_ids)
    return out


def test_none_and_a_gate_every_turn_passes_reproduce_todays_loss_exactly():
    turns = [turn for traj in TRAJS for turn in traj.turns]
    scored = with_signals(TRAJS, "context_logprob", [-1.0] * len(turns))
    today = step_loss(TRAJS, None)
    assert step_loss(scored, FamiliarityConfig(mode="none", threshold=5.0)).loss == today.loss
    passing = step_loss(scored, FamiliarityConfig(mode="gate", threshold=-9.0))
    assert passing.loss == pytest.approx(today.loss, rel=1e-12)
    assert passing.familiarity_kept_share == pytest.approx(1.0)
    shut = step_loss(scored, FamiliarityConfig(mode="gate", threshold=0.0))  # every turn gated out
    assert shut.loss == 0.0 and shut.familiarity_kept_share == 0.0


def test_a_missing_signal_is_named():
    with pytest.raises(ValueError, match="familiarity.signal=action_entropy is not in the batch"):
        step_loss(TRAJS, FamiliarityConfig(mode="gate", signal="action_entropy", threshold=1.0))


# ------------------------------------------------------------------------------------------------
# Recipe checks
# ------------------------------------------------------------------------------------------------

def test_recipes_refuse_a_control_without_threshold_and_unknown_names(tmp_path, tiny_model_dir):
    from tests.conftest import loop_models
    from turnopd.orchestration.preflight import check_setup
    from turnopd.orchestration.recipe import load_recipe

    models = loop_models(tmp_path, tiny_model_dir, LOOP)
    recipe = models / "recipe.yaml"
    with pytest.raises(RecipeError, match="'familiarity.threshold'.*familiarity.mode=gate needs a threshold"):
        load_recipe(recipe, ["familiarity.mode=gate"])
    with pytest.raises(RecipeError, match="'familiarity.mode': 'soft' is not allowed; allowed: gate, none, weight"):
        load_recipe(recipe, ["familiarity.mode=soft"])
    with pytest.raises(RecipeError, match="'familiarity.signal'.*allowed: action_entropy, action_logprob, context"):
        load_recipe(recipe, ["familiarity.signal=kl"])
    with pytest.raises(RecipeError, match="'familiarity.signals': false with familiarity.mode=weight, which scales"):
        load_recipe(recipe, ["familiarity.mode=weight", "familiarity.threshold=1.0", "familiarity.signals=false"])
    check_setup(load_recipe(recipe, ["familiarity.mode=gate", "familiarity.signal=action_entropy",
                                     "familiarity.threshold=1.0"]))  # transformers scores the exact entropy
    server = tmp_path / "server.yaml"
    server.write_text(f"name: srv\nmodel: {tiny_model_dir}\nbackend: vllm_server\nurl: http://127.0.0.1:9\n"
                      "max_length: 1024\n")
    with pytest.raises(RecipeError, match="'familiarity.topk': 0 with familiarity.signal=action_entropy"):
        check_setup(load_recipe(recipe, ["familiarity.mode=gate", "familiarity.signal=action_entropy",
                                         "familiarity.threshold=1.0", f"teachers.alfworld={server}"]))


# ------------------------------------------------------------------------------------------------
# Two steps through the real loop (real ALFWorld games, tiny models)
# ------------------------------------------------------------------------------------------------

LOOP = """
name: fam
depth: {{warmup_steps: 1, probe_every: 2, num_probes: 2, min_successes: 1}}
trainer: {{steps: 2, episodes_per_step: 2, lr: 1.0e-3}}
eval: {{max_tasks: 1, at_start: false}}
"""


def test_weight_and_gate_run_two_steps_through_the_real_loop(tmp_path, tiny_model_dir):
    from tests.conftest import loop_models
    from turnopd.core.metrics import read_metrics
    from turnopd.orchestration.distill import run_distillation
    from turnopd.orchestration.recipe import load_recipe

    recipe = loop_models(tmp_path, tiny_model_dir, LOOP) / "recipe.yaml"

    def train_records(*overrides):
        summary = run_distillation(load_recipe(recipe, list(overrides)))
        return [r for r in read_metrics(f"{summary['run_dir']}/metrics.jsonl") if r["kind"] == "train"]

    # k1: the teacher scores before the step (transformers: exact entropy); a sigmoid weight keeps 0 < share < 1
    weighted = train_records("name=weight", "familiarity.mode=weight", "familiarity.threshold=-4.0")
    assert [r["step"] for r in weighted] == [1, 2]
    for record in weighted:
        profiles = record["turn_signal_profiles"]
        assert sorted(profiles) == ["action_entropy", "action_logprob", "context_logprob"]
        assert all(len(p) == len(record["turn_kl_profile"]) for p in profiles.values())
        assert 0.0 < record["familiarity_kept_share"] < 1.0
        assert all(v > 0 for v in profiles["action_entropy"]) and all(v < 0 for v in profiles["context_logprob"])
    # full: the in-process teacher's own forward gives the signals; gate at the first step's mean entropy
    threshold = sum(weighted[0]["turn_signal_profiles"]["action_entropy"]) / len(weighted[0]["turn_kl_profile"])
    gated = train_records("name=gate", "objective.estimator=full", "familiarity.mode=gate",
                          "familiarity.signal=action_entropy", f"familiarity.threshold={threshold}")
    assert [r["step"] for r in gated] == [1, 2]
    assert all(0.0 <= r["familiarity_kept_share"] <= 1.0 for r in gated)
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in gated)
    assert sorted(gated[0]["turn_signal_profiles"]) == ["action_entropy", "action_logprob", "context_logprob"]
    plain = train_records("name=plain")
    assert all(r["familiarity_kept_share"] is None for r in plain)
