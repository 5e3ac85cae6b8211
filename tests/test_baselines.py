"""The baselines as their public code runs them (docs/baselines.md): every weight, ratio and curriculum
cap hand-worked, and checked against the formulas of TCOD's code (kokolerk/TCOD at 465eef4: its
TCOD_f2b_workflow and trinity's verl PPO loss and aggregation) and AsyncWebRL's (microsoft/webgym,
async branch: _compute_step_level_advantages, ppo_actor_loss_fn), written out here independently;
then TCOD's batching, an optimizer update per K turn rows, against plain torch."""

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import (
    configs,
    random_trajectories,
    reference_loss,
    reference_token_logprobs,
    tiny_llama,
)
from tests.trainer.test_data_parallel import LAUNCH_VARS
from tests.trainer.test_trainer import assert_adam_params_match, params
from turnopd.algorithm.controllers import CurriculumDepth, make_depth_schedule
from turnopd.algorithm.objective import k1_decoupled_loss, k1_proximal_loss, token_weights, turn_row_index
from turnopd.config import RecipeError
from turnopd.core.methods import METHODS, method_of
from turnopd.core.types import build_token_batch
from turnopd.orchestration.recipe import load_recipe
from turnopd.trainer import Trainer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
LN2 = math.log(2.0)

# The batch: turn lengths [[5, 5], [5, 5, 5, 5, 5, 5], [8]]: N_traj = 3, N_rows = 9, N_tokens = 48
TURN_LENGTHS = [[5, 5], [5] * 6, [8]]
TRAJ = torch.tensor([i for i, turns in enumerate(TURN_LENGTHS) for n in turns for _ in range(n)])
TURN = torch.tensor([t for turns in TURN_LENGTHS for t, n in enumerate(turns) for _ in range(n)])


def approx(values):
    return pytest.approx(values, rel=1e-6, abs=1e-9)


def trajectory_shares(weights: torch.Tensor) -> list[float]:
    return [float(weights[TRAJ.eq(i)].sum()) for i in range(len(TURN_LENGTHS))]


def padded_turn_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token values of the issue's batch as TCOD holds them: one right-padded row per turn,
    [N_rows, longest turn], and the response mask."""
    rows = torch.zeros(9, 8)
    mask = torch.zeros(9, 8)
    for r in range(9):
        n = int((turn_row_index(TRAJ, TURN) == r).sum())
        rows[r, :n] = values[turn_row_index(TRAJ, TURN) == r]
        mask[r, :n] = 1.0
    return rows, mask


# trinity.algorithm.utils.aggregate_loss (TCOD's loss aggregation), the two modes TCOD's configs use
def tcod_seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((values * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean()


def tcod_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / (mask.sum() + 1e-8)


# ---------------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------------


def test_trajectory_mode_weighs_trajectories_and_turn_row_mean_weighs_turns():
    # trajectory: w = 1/(N_traj n_i), so each trajectory carries 1/3 of the loss whatever its turns
    assert trajectory_shares(token_weights(TRAJ, TURN, "trajectory")) == approx([1 / 3, 1 / 3, 1 / 3])
    # turn_row_mean: w = 1/(N_rows n_it) with N_rows = 9, so trajectory i carries T_i / 9: .22 / .67 / .11
    w = token_weights(TRAJ, TURN, "turn_row_mean")
    assert trajectory_shares(w) == approx([2 / 9, 6 / 9, 1 / 9])
    assert w[:5].tolist() == approx([1 / 45] * 5) and w[-8:].tolist() == approx([1 / 72] * 8)  # 1/(9*5), 1/(9*8)
    # token_mean (TCOD's WebShop and ScienceWorld F2B, its B2F and OPD configs): n_i / 48
    assert trajectory_shares(token_weights(TRAJ, TURN, "token_mean")) == approx([10 / 48, 30 / 48, 8 / 48])


def test_turn_row_mean_is_tcods_seq_mean_token_mean_over_its_turn_rows():
    loss = torch.rand(48, generator=torch.Generator().manual_seed(0))
    rows, mask = padded_turn_rows(loss)
    # verl's actor (use_dynamic_bsz) scales each micro-batch's aggregate by its rows / the minibatch's
    # rows, so an update's loss is the mean over all its rows; here two micro-batches of 4 and 5 rows
    tcod = sum(tcod_seq_mean_token_mean(rows[m], mask[m]) * (m.stop - m.start) / 9 for m in (slice(0, 4), slice(4, 9)))
    assert float((token_weights(TRAJ, TURN, "turn_row_mean") * loss).sum()) == pytest.approx(float(tcod), rel=1e-6)
    # token_mean equals TCOD's token-mean when the minibatch is one micro-batch (see docs/baselines.md)
    assert float((token_weights(TRAJ, TURN, "token_mean") * loss).sum()) == pytest.approx(
        float(tcod_token_mean(rows, mask)), rel=1e-6)


def test_constant_and_constant_token_mean_differ_by_tokens_per_trajectory():
    # constant (AsyncWebRL's docs, 1/(G k)): w = 1/(N_traj k) = 1/30 with k = 10 turns; trajectory i
    # carries n_i / 30 and the weights total 48/30 = 1.6
    docs = token_weights(TRAJ, TURN, "constant", constant_k=10)
    assert docs.tolist() == approx([1 / 30] * 48)
    assert trajectory_shares(docs) == approx([10 / 30, 30 / 30, 8 / 30])
    # constant_token_mean (AsyncWebRL's code): w = 1/(k N_tokens) = 1/480; the weights total 1/k = 0.1
    code = token_weights(TRAJ, TURN, "constant_token_mean", constant_k=10)
    assert code.tolist() == approx([1 / 480] * 48)
    assert float(code.sum()) == pytest.approx(0.1)
    # the totals differ by N_tokens / N_traj = 16, a factor that moves with the batch's lengths
    assert float(docs.sum()) / float(code.sum()) == pytest.approx(48 / 3)


def test_global_turn_row_count_for_a_rank_holding_part_of_the_batch():
    # a rank with trajectory 1 alone (6 rows) of the 9-row global batch: each of its rows 1/9
    mine = TRAJ == 1
    w = token_weights(TRAJ[mine], TURN[mine], "turn_row_mean", num_turn_rows=9)
    assert float(w.sum()) == pytest.approx(6 / 9)


# ---------------------------------------------------------------------------------------------------
# Estimators: TCOD's (verl PPO on recomputed old log-probs) and AsyncWebRL's decoupled PPO
# ---------------------------------------------------------------------------------------------------


def verl_ppo_token_loss(logprob, old_logprob, advantages, clip, clip_ratio_c):
    """trinity's PPOPolicyLossFn per token (TCOD's policy loss), before aggregation."""
    ratio = torch.exp(torch.clamp(logprob - old_logprob, -20.0, 20.0))
    clipped = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip))
    dual = torch.minimum(-advantages * clip_ratio_c, clipped)
    return torch.where(advantages < 0, dual, clipped)


def areal_decoupled_token_loss(logprobs, proximal, old, advantages, eps_clip, c_clip, cap):
    """AReaL's ppo_actor_loss_fn per token, with use_decoupled_loss and token-level ratios (AsyncWebRL's)."""
    ratio = torch.exp(logprobs - proximal)
    pg = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_clip, 1 + eps_clip))
    pg = torch.min(pg, torch.sign(advantages) * c_clip * advantages)
    behave = torch.exp(proximal - old)
    return pg * torch.where(behave <= cap, behave, 0.0)


def areal_token_mean(per_token: torch.Tensor) -> torch.Tensor:
    """ppo_actor_loss_fn's reduction: the sum over the minibatch's tokens, dropped ones included, over
    their global count (the engine's loss_weight_fn, loss_mask.count_nonzero())."""
    return per_token.sum() / per_token.numel()


def test_k1_proximal_hand_worked():
    # s = ln .75, ln .4, ln .3 against T = ln .25, ln .05, ln .4: the value s - T = ln 3, ln 8, ln .75,
    # the gradient the same (s - T) per token: ratio 1 around the update's own log-prob
    student = torch.log(torch.tensor([0.75, 0.4, 0.3])).requires_grad_()
    teacher = torch.log(torch.tensor([0.25, 0.05, 0.4]))
    loss = k1_proximal_loss(student, teacher)
    assert loss.tolist() == approx([math.log(3), math.log(8), math.log(0.75)])
    loss.sum().backward()
    assert student.grad.tolist() == approx([math.log(3), math.log(8), math.log(0.75)])


def test_k1_proximal_is_tcods_ppo_loss_on_recomputed_old_log_probs():
    g = torch.Generator().manual_seed(1)
    student = (-torch.rand(200, generator=g) * 4).requires_grad_()
    teacher = -torch.rand(200, generator=g) * 4
    # TCOD: old log-probs recomputed by the trainer before the update (so equal to the student's),
    # advantage kl_coef (1) * (teacher - old), clip 0.2, dual clip 3
    old = student.detach()
    tcod = verl_ppo_token_loss(student, old, teacher - old, clip=0.2, clip_ratio_c=3.0)
    ours = k1_proximal_loss(student, teacher)
    assert ours.tolist() == approx(tcod.tolist())
    assert torch.autograd.grad(ours.sum(), student)[0].tolist() == approx(
        torch.autograd.grad(tcod.sum(), student)[0].tolist())


def test_k1_decoupled_ratio_clip_and_dual_clip_hand_worked():
    log = torch.log
    # behaviour weight 1 (s_old = s_prox), so the PPO surrogate on pi_theta / pi_prox alone:
    # token 0: s_prox = ln .5, s = ln .75 (r = 1.5), T = ln .25: A = -ln 2 < 0, unclipped: -r A = 1.5 ln 2
    # token 1: s_prox = ln .1, s = ln .4 (r = 4), T = ln .05: A = -ln 2, -r A = 4 ln 2 > the dual clip 3 ln 2
    # token 2: s_prox = ln .2, s = ln .3 (r = 1.5), T = ln .4: A = ln 2 > 0, clipped to -1.2 ln 2
    student = log(torch.tensor([0.75, 0.4, 0.3])).requires_grad_()
    proximal, teacher = log(torch.tensor([0.5, 0.1, 0.2])), log(torch.tensor([0.25, 0.05, 0.4]))
    loss = k1_decoupled_loss(student, proximal, proximal, teacher, clip_eps=0.2, dual_clip=3.0)
    assert loss.tolist() == approx([1.5 * LN2, 3 * LN2, -1.2 * LN2])
    loss.sum().backward()
    # dl/ds = -A r on the unclipped token; the clipped ones pass no gradient
    assert student.grad.tolist() == approx([1.5 * LN2, 0.0, 0.0])


def test_k1_decoupled_behaviour_weight_and_cap_hand_worked():
    log = torch.log
    # token 0: behaviour weight b = pi_prox / pi_behave = .5 / .25 = 2 times token 0 above: 3 ln 2
    # token 1: b = .6 / .1 = 6 > the cap 5: dropped
    # token 2: b = .4 / .4 = 1; r = .1 / .4 = .25 with A = ln(.8 / .4) = ln 2 > 0: unclipped -r A = -.25 ln 2
    student = log(torch.tensor([0.75, 0.6, 0.1])).requires_grad_()
    proximal = log(torch.tensor([0.5, 0.6, 0.4]))
    old = log(torch.tensor([0.25, 0.1, 0.4]))
    teacher = log(torch.tensor([0.25, 0.3, 0.8]))
    loss = k1_decoupled_loss(student, proximal, old, teacher, clip_eps=0.2, dual_clip=3.0, behave_weight_cap=5.0)
    assert loss.tolist() == approx([2 * 1.5 * LN2, 0.0, -0.25 * LN2])
    loss.sum().backward()
    assert student.grad.tolist() == approx([2 * 1.5 * LN2, 0.0, -0.25 * LN2])  # dl/ds = -b r A
    # without a cap token 1 stays, at b = 6: r = 1, A = ln(.3/.6) = -ln 2, l = 6 ln 2
    uncapped = k1_decoupled_loss(student, proximal, old, teacher, 0.2, 3.0, None)
    assert float(uncapped[1].detach()) == pytest.approx(6 * LN2)


def test_k1_decoupled_under_constant_token_mean_is_asyncwebrls_loss():
    """AsyncWebRL divides a step's advantage by k = 10 and takes the token mean over the minibatch,
    dropped tokens counted in the denominator; TurnOPD weighs k1_decoupled's l by 1/(k N_tokens)."""
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(48, generator=g) * 4
    proximal = old + torch.randn(48, generator=g) * 1.0  # some behaviour weights above the cap of 5
    student = proximal + torch.randn(48, generator=g) * 0.3
    teacher = -torch.rand(48, generator=g) * 4
    k = 10.0
    ours = (token_weights(TRAJ, TURN, "constant_token_mean", constant_k=k)
            * k1_decoupled_loss(student, proximal, old, teacher, 0.2, 3.0, 5.0)).sum()
    theirs = areal_token_mean(areal_decoupled_token_loss(student, proximal, old, (teacher - proximal) / k, 0.2, 3.0, 5.0))
    assert bool((torch.exp(proximal - old) > 5).any())  # the cap drops some tokens
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# TCOD's curriculum
# ---------------------------------------------------------------------------------------------------


def tcod_turns(explorer_step: int, checkpoint_steps: int, max_env_steps: int) -> int:
    """TCOD_f2b_workflow: distill window 1 + current_step // checkpoint_steps, current_step the batch_id
    (explore_step_num + 1, from 1), the episode's turns min(window, max_env_steps)."""
    return min(1 + explorer_step // checkpoint_steps, max_env_steps)


@pytest.mark.parametrize(("interval", "horizon", "steps", "first_full"), [(6, 30, 250, 173), (4, 15, 150, 55)])
def test_curriculum_counted_from_one_is_tcods(interval, horizon, steps, first_full):
    """ALFWorld (checkpoint_steps 6, max_env_steps 30, 250 steps) and WebShop (4, 15, 150)."""
    tcod = CurriculumDepth(interval, horizon, first_step=1)
    assert [tcod.cap_at(k) for k in range(steps)] == [tcod_turns(k + 1, interval, horizon) for k in range(steps)]
    assert [tcod.cap_at(k) for k in range(interval + 1)] == [1] * (interval - 1) + [2, 2]  # grows at step index interval - 1
    assert tcod.cap_at(first_full) == horizon > tcod.cap_at(first_full - 1)
    assert CurriculumDepth(interval, horizon).cap_at(interval - 1) == 1  # TurnOPD's count from 0: a step later


@pytest.mark.parametrize(("recipe", "interval"), [("alfworld/gpu/tcod.yaml", 6), ("webshop/gpu/tcod.yaml", 4),
                                                  ("alfworld/tcod.yaml", 6), ("webshop/tcod.yaml", 4)])
def test_tcod_recipes_take_tcods_interval_per_env(recipe, interval):
    cfg = load_recipe(RECIPES / recipe)
    depth = make_depth_schedule(cfg.depth, cfg.env.max_turns)
    assert [depth.cap_at(k) for k in range(cfg.trainer.steps)] == [
        tcod_turns(k + 1, interval, cfg.env.max_turns) for k in range(cfg.trainer.steps)]
    assert cfg.trainer.turn_rows_per_update == 64
    assert cfg.loss.mode == ("token_mean" if recipe.startswith("webshop") else "turn_row_mean")


# ---------------------------------------------------------------------------------------------------
# The methods and the recipe rules
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "needs"), [
    ("tcod_f2b", []), ("tcod_f2b_token_mean", []), ("curriculum_trajectory", []), ("asyncwebrl_constant", []),
    ("asyncwebrl_decoupled", []),
    ("asyncwebrl_constant_reward", ["trainer.group_size=2", "objective.estimator=k1"]),  # the reward term's
])
def test_baseline_methods_are_recipe_choices(method, needs):
    cfg = load_recipe(RECIPES / "quickstart.yaml", [*METHODS[method], *needs])
    assert method_of(dataclasses.asdict(cfg)) == method


BASE = """
name: base-run
student: {path: /models/student}
teachers: {alfworld: teachers/alfworld/teacher.yaml}
env: {name: alfworld, max_turns: 50}
"""


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.turn_rows_per_update=64", "trainer.lr_schedule=cosine"],
     "'trainer.turn_rows_per_update': 64 with trainer.lr_schedule=cosine and lr_warmup_steps=0; the schedule counts "
     "optimizer updates"),
    (["trainer.turn_rows_per_update=64", "trainer.lr_warmup_steps=2"], "use a constant lr without warm-up"),
    (["trainer.turn_rows_per_update=0"], "recipe key 'trainer.turn_rows_per_update': 0 is out of range"),
    (["loss.mode=constant_token_mean"], "recipe key 'loss.constant_k': None; loss.mode=constant_token_mean needs "
                                        "constant_k > 0 (in turns)"),
    (["objective.dual_clip=1.0"], "recipe key 'objective.dual_clip': 1.0; it needs c > 1"),
    (["objective.estimator=k3", "objective.dual_clip=3"], "an estimator with an importance ratio (k1, k1_decoupled), "
                                                          "got k3"),
    (["objective.estimator=k1_proximal", "objective.clip_eps=0.2"], "'objective.clip_eps': 0.2; it clips the "
                                                                    "importance ratio of an estimator that has one (k1, "
                                                                    "k1_decoupled), and k1_proximal has none"),
    (["objective.behave_weight_cap=5"], "'objective.behave_weight_cap': 5.0; it caps the behaviour weight "
                                        "pi_prox / pi_behave of k1_decoupled, and k1 has none"),
    (["depth.curriculum_first_step=2"], "recipe key 'depth.curriculum_first_step': 2 is not allowed; allowed: 0, 1"),
])
def test_recipe_rules_of_the_baselines(tmp_path, overrides, message):
    (tmp_path / "base.yaml").write_text(BASE)
    with pytest.raises(RecipeError) as err:
        load_recipe(tmp_path / "base.yaml", overrides)
    assert message in str(err.value)


def test_clip_eps_is_allowed_on_every_estimator_with_a_ratio(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    for estimator in ("k1", "k1_decoupled"):
        load_recipe(tmp_path / "base.yaml", [f"objective.estimator={estimator}", "objective.clip_eps=0.2",
                                             "objective.dual_clip=3"])


# ---------------------------------------------------------------------------------------------------
# TCOD's batching: an optimizer update per K turn rows, against plain torch
# ---------------------------------------------------------------------------------------------------

TRAJS = random_trajectories(seed=6, count=6)  # turns 1, 3, 3, 2, 4, 1; the even ones one sequence each
ROWS = [(i, t) for i, traj in enumerate(TRAJS) for t, turn in enumerate(traj.turns) if turn.action_ids]
TOKENS_OF_ROW = [len(TRAJS[i].turns[t].action_ids) for i, t in ROWS]


def chunk_weights(chunk: list[int]) -> list[float]:
    """turn_row_mean over the rows of one update: 1/(rows * n_row) on its tokens, 0 on the others."""
    return [1.0 / (len(chunk) * n) if r in chunk else 0.0 for r, n in enumerate(TOKENS_OF_ROW) for _ in range(n)]


def plain_updates(model, chunks, loss_of) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One AdamW step per chunk of rows on sum_p w_p l_p, as the trainer configures it."""
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.01},
                             {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}], lr=1e-2)
    losses, norms = [], []
    for chunk in chunks:
        opt.zero_grad()
        loss = loss_of(model, chunk_weights(chunk))
        loss.backward()
        losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
    return params(model), losses, norms


@pytest.mark.parametrize("estimator", ["k1", "full"])
def test_an_update_per_k_turn_rows_is_plain_adamw_per_chunk_of_rows(estimator):
    # 14 rows: 5 updates of 3, 3, 3, 3 and 2 rows; trajectories 2 and 4 (one sequence each) span two
    assert len(ROWS) == 14
    chunks = [list(range(start, min(start + 3, len(ROWS)))) for start in range(0, len(ROWS), 3)]
    teacher = tiny_llama(1) if estimator == "full" else None
    trainer = Trainer(tiny_llama(0), *configs(estimator, "turn_row_mean", turn_rows_per_update=3, micro_batch_tokens=40),
                      total_steps=2, teacher_model=copy.deepcopy(teacher))
    metrics = trainer.step(build_token_batch(TRAJS), alpha=0.0)
    expected, losses, norms = plain_updates(tiny_llama(0), chunks, lambda model, w: reference_loss(
        model, TRAJS, estimator, "", 0.0, teacher=teacher, weights=w))
    assert metrics.optimizer_updates == 5 and not metrics.skipped
    assert metrics.loss == pytest.approx(sum(losses) / 5, rel=1e-5)
    assert metrics.grad_norm == pytest.approx(sum(norms) / 5, rel=1e-4)
    if estimator == "k1":
        assert_adam_params_match(params(trainer.module), expected)
    else:  # the chunked full-vocabulary KL's float noise (first update's gradient norm equal to 1e-7),
        # grown by four more Adam steps on the elements with near-zero gradients, stays far below lr
        got = params(trainer.module)
        assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 5e-4


TOKENS = [(turn, j) for traj in TRAJS for turn in traj.turns for j in range(len(turn.action_ids))]
TEACHER = torch.tensor([turn.teacher_logprobs[j] for turn, j in TOKENS])
SAMPLING = torch.tensor([turn.student_logprobs[j] for turn, j in TOKENS])


def student_logprobs(model) -> torch.Tensor:
    return torch.stack([row[turn.action_ids[j]] for row, (turn, j) in
                        zip(reference_token_logprobs(model, TRAJS), TOKENS, strict=True)])


def test_k1_decoupled_reads_the_log_probs_the_step_started_from():
    """Its updates after the first train on the ratio to the weights before the first (a forward
    before it, as AReaL recomputes prox_logp once per batch of minibatch updates)."""
    chunks = [list(range(start, min(start + 5, len(ROWS)))) for start in range(0, len(ROWS), 5)]
    trainer_cfg, objective, loss_cfg = configs("k1_decoupled", "turn_row_mean", turn_rows_per_update=5,
                                               micro_batch_tokens=40)
    objective = dataclasses.replace(objective, clip_eps=0.2, dual_clip=3.0, behave_weight_cap=1.5)
    trainer = Trainer(tiny_llama(0), trainer_cfg, objective, loss_cfg, total_steps=2)
    metrics = trainer.step(build_token_batch(TRAJS), alpha=0.0)
    proximal = student_logprobs(tiny_llama(0)).detach()
    assert 0 < int((torch.exp(proximal - SAMPLING) > 1.5).sum()) < len(TOKENS)  # the cap drops some tokens

    def loss_of(model, weights):
        per_token = areal_decoupled_token_loss(student_logprobs(model), proximal, SAMPLING, TEACHER - proximal,
                                               eps_clip=0.2, c_clip=3.0, cap=1.5)
        return (torch.tensor(weights) * per_token).sum()

    expected, losses, _ = plain_updates(tiny_llama(0), chunks, loss_of)
    assert metrics.optimizer_updates == 3
    assert metrics.loss == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert_adam_params_match(params(trainer.module), expected)


def test_k1_proximal_trains_each_update_on_its_own_log_probs():
    """TCOD recomputes the old log-probs before each 64-row update: every update is on-policy, its
    loss TCOD's PPO loss with the old log-probs at the weights the update starts from."""
    chunks = [list(range(start, min(start + 5, len(ROWS)))) for start in range(0, len(ROWS), 5)]
    trainer = Trainer(tiny_llama(0), *configs("k1_proximal", "turn_row_mean", turn_rows_per_update=5,
                                              micro_batch_tokens=40), total_steps=2)
    metrics = trainer.step(build_token_batch(TRAJS), alpha=0.0)
    def loss_of(model, weights):
        student = student_logprobs(model)
        old = student.detach()
        per_token = verl_ppo_token_loss(student, old, TEACHER - old, clip=0.2, clip_ratio_c=3.0)
        return (torch.tensor(weights) * per_token).sum()

    expected, losses, _ = plain_updates(tiny_llama(0), chunks, loss_of)
    assert metrics.optimizer_updates == 3
    assert metrics.loss == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert_adam_params_match(params(trainer.module), expected)


@pytest.mark.slow
def test_ranks_with_unequal_rows_take_the_same_updates(tmp_path):
    """Two ranks, 2 turn rows an update each (4 over both): the rank with fewer rows runs empty updates,
    padded, so both take the most updates any rank needs and hold the same weights after the step."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(RECIPES.parent), HF_HUB_OFFLINE="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "tests.trainer.dp_rows_worker",
                             str(tmp_path)], cwd=RECIPES.parent, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rows"] > ranks[1]["rows"]
    assert [r["optimizer_updates"] for r in ranks] == [math.ceil(ranks[0]["rows"] / 2)] * 2
    assert not ranks[0]["skipped"] and math.isfinite(ranks[0]["loss"]) and ranks[0]["loss"] == ranks[1]["loss"]
    assert ranks[0]["parameter_sum"] == ranks[1]["parameter_sum"]
