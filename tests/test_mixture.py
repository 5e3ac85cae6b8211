"""Multi-env runs (recipe key `envs`): the mixture's per-step counts, its recipe checks, each env's
depth controller fed only its own probes, the per-env record fields and the loss weights of a mixed
batch, all against hand-worked numbers."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from turnopd.algorithm.controllers import DepthController, EnvDepths
from turnopd.algorithm.mixture import apportion, mixture_episodes
from turnopd.algorithm.objective import token_weights
from turnopd.config import RecipeError, check_consistency, env_views, validate
from turnopd.core.types import EpisodeSummary, Trajectory, Turn, build_token_batch
from turnopd.orchestration.pipeline import MixturePlan, per_env_fields
from turnopd.orchestration.pipeline.plan import BatchPlan
from turnopd.orchestration.recipe import BACKEND_REGISTRIES, check_screenshots, load_recipe

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "multi" / "alfworld_search.yaml"


@pytest.mark.parametrize("total, weights, counts", [
    (8, [0.5, 0.3, 0.2], [4, 2, 2]),  # quotas 4, 2.4, 1.6: floors 4, 2, 1; the unit left to .6
    (5, [0.5, 0.5], [3, 2]),  # quotas 2.5, 2.5: the tie to the first
    (10, [0.1, 0.9], [1, 9]),  # exact quotas (0.1 * 10 is 1.0000000000000002 in floats)
    (3, [0.6, 0.2, 0.2], [2, 1, 0]),  # quotas 1.8, .6, .6: floors 1, 0, 0; two left: .8, then the tied .6 first
])
def test_apportion_by_largest_remainder(total, weights, counts):
    assert apportion(total, weights) == counts


def test_mixture_episodes_in_whole_groups_or_fixed():
    # 8 episodes in groups of 2: 4 groups by 0.7 / 0.3 are quotas 2.8 / 1.2 -> 2 + 1, the last to .8: 3, 1
    assert mixture_episodes(8, 2, [0.7, 0.3], None) == [6, 2]
    assert mixture_episodes(8, 1, None, [5, 3]) == [5, 3]


def mixture_recipe(**keys) -> dict:
    """A two-env recipe (alfworld + search), `keys` merged over it (dotted keys)."""
    cfg = OmegaConf.create({
        "name": "mix", "student": {"path": "s"}, "tracking": [],
        "teachers": {"alfworld": "a.yaml", "search": "b.yaml"},
        "env": {"name": "alfworld", "max_turns": 40, "options": {"notes": True}},
        "envs": {"alfworld": {"weight": 0.75}, "search": {"weight": 0.25, "max_turns": 4, "options": {"top_k": 1}}},
        "trainer": {"episodes_per_step": 8}})
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def checked(cfg):
    return validate(cfg, checks=(check_consistency,), registries=BACKEND_REGISTRIES)


def test_each_env_sees_the_env_block_with_its_own_keys():
    views = env_views(checked(mixture_recipe()))
    assert list(views) == ["alfworld", "search"]
    alfworld, search = views["alfworld"], views["search"]
    assert (alfworld.env.name, alfworld.env.max_turns, alfworld.env.options) == ("alfworld", 40, {"notes": True})
    # a mapping (options) is replaced whole, not merged with the env block's
    assert (search.env.name, search.env.max_turns, search.env.options) == ("search", 4, {"top_k": 1})
    # 8 episodes by 0.75 / 0.25: 6 and 2
    assert (alfworld.trainer.episodes_per_step, search.trainer.episodes_per_step) == (6, 2)
    assert alfworld.envs == {} and search.envs == {}


def test_fixed_episodes_per_env():
    cfg = mixture_recipe(**{"envs.alfworld": {"episodes_per_step": 5}, "envs.search": {"episodes_per_step": 3}})
    views = env_views(checked(cfg))
    assert [v.trainer.episodes_per_step for v in views.values()] == [5, 3]


@pytest.mark.parametrize("keys, message", [
    ({"teachers": {"alfworld": "a.yaml"}}, "recipe key 'teachers': no teacher for env 'search'; "
                                           "set teachers.search=<path to teacher.yaml>"),
    ({"envs.search.weight": 0.15}, "recipe key 'envs': the weights sum to 0.9; they must sum to 1"),
    ({"envs.alfworld": {"episodes_per_step": 5}, "envs.search": {"episodes_per_step": 2}},
     "recipe key 'envs': episodes_per_step sum to 7, and trainer.episodes_per_step is 8; make them equal"),
    ({"envs.alfworld": {"episodes_per_step": 6}}, "recipe key 'envs.search': give each env one of weight or "
                                                  "episodes_per_step, the same one for every env"),
    ({"envs.alfworld.weight": 0.95, "envs.search.weight": 0.05},
     "recipe key 'envs.search': 0 episodes a step; every env needs whole groups of trainer.group_size=1"),
    ({"envs.search.weight": "half"}, "recipe key 'envs.search.weight': 'half'; a share is a number > 0"),
    ({"envs.search": 0.25}, "recipe key 'envs.search': 0.25 is a value; give a mapping, e.g. {weight: 0.5}"),
    ({"envs.search.max_turn": 4}, "recipe key 'envs.search.max_turn': Key 'max_turn' not in 'EnvConfig'"),
    ({"envs.nosuch": {"weight": 0.0}}, "recipe key 'envs.nosuch.name': 'nosuch' is not allowed"),
    ({"pipeline.mode": "pool", "pipeline.wave_episodes": 2, "envs.alfworld.weight": 0.75, "envs.search.weight": 0.25},
     "recipe key 'pipeline.wave_episodes': 2 gives env 'search' no whole group"),
    ({"depth.h_min": 5}, "recipe key 'depth.h_min'=5 exceeds the horizon 'env.max_turns'=4"),
])
def test_bad_mixtures_are_refused_naming_the_key(keys, message):
    with pytest.raises(RecipeError) as err:
        checked(mixture_recipe(**keys))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_budget_in_work_holds_across_the_mixture():
    """8 episodes by 0.75 / 0.25: ALFWorld's 6 at 40 turns, search's 2 at 4, an env step each. The
    budget keeps the mixture's first episodes in the order a, a, b, a, a, a, b, a: with 100 env steps
    left, a + a + b = 84 < 100 and the 4th (a) reaches it, so the step plays 3 ALFWorld episodes and 1
    search one, at most 124: past the budget by less than one episode (40). With 50 left, a + a = 80:
    no search episode, and search has no plan this step."""
    from turnopd.orchestration.pipeline import make_depth, plan_step, plan_work_bound
    from turnopd.orchestration.pipeline.mixture import mixture_order

    cfg = checked(mixture_recipe(**{"trainer.budget": {"unit": "env_steps", "amount": 100}}))
    assert mixture_order({"alfworld": 6, "search": 2}) == ["alfworld", "alfworld", "search"] + ["alfworld"] * 3 + [
        "search", "alfworld"]
    depth = make_depth(cfg)
    whole = plan_step(depth, 0, cfg)
    assert plan_work_bound(cfg, whole) == 6 * 40 + 2 * 4
    assert plan_step(depth, 0, cfg, 1000) == whole
    cut = plan_step(depth, 0, cfg, 100)
    assert {env: p.turn_limits for env, p in cut.envs.items()} == {"alfworld": (40,) * 3, "search": (4,)}
    assert plan_work_bound(cfg, cut) == 124
    assert {env: p.turn_limits for env, p in plan_step(depth, 0, cfg, 50).envs.items()} == {"alfworld": (40, 40)}
    tokens = checked(mixture_recipe(**{"trainer.budget": {"unit": "tokens_generated", "amount": 100}}))
    assert plan_work_bound(tokens, plan_step(depth, 0, tokens)) == (6 * 40 + 2 * 4) * tokens.policy.max_new_tokens


def test_pool_waves_are_shared_out_like_steps():
    """pipeline.wave_episodes 4 of a 0.75 / 0.25 mixture: 3 and 1 (apportioned as a step's 8 are, 6 and 2);
    none given: each env's waves are its step's share."""
    views = env_views(checked(mixture_recipe(**{"pipeline.mode": "pool", "pipeline.wave_episodes": 4})))
    assert [v.pipeline.wave_episodes for v in views.values()] == [3, 1]
    assert [v.pipeline.wave_episodes for v in env_views(checked(mixture_recipe())).values()] == [None, None]


def test_a_screenshot_env_is_refused_in_a_mixture():
    cfg = mixture_recipe(envs={"alfworld": {"weight": 0.75}, "webshop_screenshot": {"weight": 0.25}},
                         **{"teachers.webshop_screenshot": "w.yaml"})
    with pytest.raises(RecipeError, match="^recipe key 'envs': env 'webshop_screenshot' shows screenshots; a "
                                          "multi-env run plays text envs"):
        validate(cfg, checks=(check_consistency, check_screenshots), registries=BACKEND_REGISTRIES)


def test_the_recipe_validates_with_a_teacher_per_env():
    cfg = load_recipe(RECIPE)
    assert set(cfg.teachers) == {"alfworld", "search"}
    views = env_views(cfg)
    assert {env: (v.env.max_turns, v.trainer.episodes_per_step) for env, v in views.items()} == {
        "alfworld": (40, 4), "search": (4, 4)}


def probe(env: str, kl: list[float], won: bool) -> Trajectory:
    turns = [Turn(t, "", [1], [2], [0.0]) for t in range(len(kl))]
    return Trajectory(f"{env}-{len(kl)}-{won}", env, turns, success=won, is_probe=True)


def test_each_env_controller_reads_only_its_own_probes():
    depths = EnvDepths({"alfworld": DepthController(h_min=1, h_max=10, min_successes=1, quantile=1.0, ema=1.0),
                        "search": DepthController(h_min=1, h_max=4, min_successes=1, quantile=1.0, ema=1.0)})
    batch = [probe("alfworld", [1, 1, 1, 1, 1, 1], True), probe("search", [3, 1], True),
             probe("alfworld", [2, 2], False), probe("search", [1, 1, 1, 1], False)]
    assert depths.update_from(batch, [[1, 1, 1, 1, 1, 1], [3, 1], [2, 2], [1, 1, 1, 1]])
    # alfworld: turn masses (1+2)/2 * 2/2 = 1.5, 1.5, then 1 * 1/2 = .5 for turns 3-6;
    # H_eff = (1*1.5 + 2*1.5 + (3+4+5+6)*.5) / 5 = 13.5 / 5 = 2.7 -> 3; H_cov = the won probe's 6 turns
    # search: masses (3+1)/2 = 2, (1+1)/2 = 1, then .5, .5; H_eff = (2 + 2 + 1.5 + 2) / 4 = 1.875 -> 2;
    # H_cov = 2 (the won probe's turns)
    diagnostics = depths.diagnostics()
    assert {env: (d["h_eff"], d["h_cov"]) for env, d in diagnostics.items()} == {
        "alfworld": (3.0, 6.0), "search": (2.0, 2.0)}
    assert depths.schedules["alfworld"].cap == 6 and depths.schedules["search"].cap == 2
    # a checkpoint keeps each env's controller
    restored = EnvDepths({"alfworld": DepthController(h_max=10), "search": DepthController(h_max=4)})
    restored.load_state_dict(depths.state_dict())
    assert (restored.schedules["alfworld"].cap_at(9), restored.schedules["search"].cap_at(9)) == (6, 2)


def test_a_mixed_step_record_has_each_env_s_fields():
    depths = EnvDepths({"alfworld": DepthController(h_max=10), "search": DepthController(h_max=4)})
    plan = MixturePlan(3, {"alfworld": BatchPlan(3, (10, 6, 6)), "search": BatchPlan(3, (4, 2), probes=1)})
    assert (plan.episodes, plan.probes, plan.cap, plan.is_probe_step) == (5, 1, 6, False)

    def episode(env, depth, won):
        return EpisodeSummary("t", "", won, depth, False, 0, 0, "", env_name=env)
    episodes = [episode("alfworld", 10, False), episode("alfworld", 6, True), episode("alfworld", 2, True),
                episode("search", 4, True), episode("search", 2, False)]
    fields = per_env_fields(depths, plan, False, episodes)
    assert fields == {
        "alfworld": {"rollout_depth_cap": 6, "probes": 0, "episodes": 3, "mean_turns": 6.0, "success_rate": 2 / 3,
                     "h_eff": None, "h_cov": None, "h_cov_measured": None},
        "search": {"rollout_depth_cap": 2, "probes": 1, "episodes": 2, "mean_turns": 3.0, "success_rate": 0.5,
                   "h_eff": None, "h_cov": None, "h_cov_measured": None}}


def test_mixed_batch_loss_weights_share_by_trajectory_whatever_the_horizon():
    """A 3-turn ALFWorld trajectory (2, 1, 1 tokens) and a 1-turn search one (4 tokens), progressive
    alpha 0.5: w = ((1 - a) / n_i + a / (T_i n_it)) / N_traj. ALFWorld's turn 1 tokens: (.5/4 + .5/6) / 2
    = 5/48 each, turns 2 and 3: (.5/4 + .5/3) / 2 = 7/48; search: (.5/4 + .5/4) / 2 = 1/8 each. Each
    trajectory (each env, one episode each) weighs 1/2, its turns sharing it."""
    traj = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    turn = torch.tensor([0, 0, 1, 2, 0, 0, 0, 0])
    w = token_weights(traj, turn, "progressive", alpha=0.5)
    expected = torch.tensor([5 / 48, 5 / 48, 7 / 48, 7 / 48, 1 / 8, 1 / 8, 1 / 8, 1 / 8], dtype=w.dtype)
    torch.testing.assert_close(w, expected)
    assert float(w[:4].sum()) == pytest.approx(0.5) and float(w[4:].sum()) == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["token_mean", "progressive"])
def test_in_process_teachers_each_read_their_own_env_s_sequences(mode):
    """estimator full with a teacher per env in the training process: the step's loss is the sum over
    tokens of the mixed batch's weights times the reverse KL to the token's own env's teacher; with one
    teacher for all it would differ."""
    from tests.trainer.helpers import (
        configs,
        random_trajectories,
        reference_loss,
        reference_weights,
        tiny_llama,
    )
    from turnopd.trainer import Trainer

    trajs = random_trajectories(seed=0, count=4)
    trajs = [dataclasses.replace(t, env_name=env) for t, env in zip(trajs, ["a", "b", "a", "b"], strict=True)]
    teachers = {"a": tiny_llama(seed=1), "b": tiny_llama(seed=2)}
    trainer = Trainer(tiny_llama(seed=0), *configs("full", mode, micro_batch_tokens=40), total_steps=2,
                      teacher_model={env: copy.deepcopy(t) for env, t in teachers.items()})
    weights = reference_weights(trajs, mode, alpha=0.3)
    sizes = [sum(len(turn.action_ids) for turn in t.turns) for t in trajs]
    starts = [sum(sizes[:i]) for i in range(len(trajs))]
    student = tiny_llama(seed=0)
    expected = sum(reference_loss(student, [t], "full", mode, 0.3, teacher=teachers[t.env_name],
                                  weights=weights[start:start + size]).item()
                   for t, start, size in zip(trajs, starts, sizes, strict=True))
    one_teacher = reference_loss(student, trajs, "full", mode, 0.3, teacher=teachers["a"]).item()
    result = trainer.step(build_token_batch(trajs), alpha=0.3)
    assert result.loss == pytest.approx(expected, rel=1e-5) and abs(expected - one_teacher) > 1e-4
    assert result.num_micro_batches >= 2  # one env's sequences a micro-batch


MIXED_RECIPE = """
name: mixed
envs:
  alfworld: {{episodes_per_step: 2}}
  search: {{episodes_per_step: 2, max_turns: 2, history_length: 0, train_split: train, eval_split: test,
           options: {{top_k: 1}}}}
depth: {{warmup_steps: 1, probe_every: 1, min_successes: 1}}
trainer: {{steps: 2, episodes_per_step: 4, lr: 1.0e-3}}
eval: {{max_tasks: 1}}
"""


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_model_dir):
    """The loop tests' student and ALFWorld teacher, and a search teacher that differs from it (another
    initialization, the same tokenizer)."""
    from tests.conftest import TINY_MODEL_SIZE, loop_models
    from turnopd.models.tiny import build_tiny_model

    root = loop_models(tmp_path_factory.mktemp("mixed"), tiny_model_dir, MIXED_RECIPE)
    build_tiny_model(root / "search_teacher", tokenizer=tiny_model_dir, **TINY_MODEL_SIZE, seed=9)
    (root / "search_teacher.yaml").write_text(f"name: search-teacher\nmodel: {root}/search_teacher\n"
                                              "backend: transformers\ndtype: float32\nmax_length: 1024\n")
    return root


def test_topk_cross_maps_one_teacher_s_vocabulary_and_refuses_a_mixture_of_several(mixed):
    from turnopd.orchestration.preflight import dry_run

    with pytest.raises(RecipeError, match=r"^recipe key 'objective.estimator': topk_cross maps one teacher's "
                                          r"vocabulary into the student's, and this multi-env run \(envs\) has several"):
        dry_run(load_recipe(mixed / "recipe.yaml", ["objective.tokenizers=cross", "objective.estimator=topk_cross"]))


def test_a_teacher_whose_tokenizer_is_not_the_student_s_is_refused_at_recipe_check(mixed, tmp_path):
    from turnopd.models.tiny import build_tiny_model
    from turnopd.orchestration.preflight import dry_run

    build_tiny_model(tmp_path / "other", ["a completely different corpus of words, spelled differently"] * 3,
                     hidden_size=64, num_layers=1, num_heads=2, seed=3)
    (tmp_path / "other.yaml").write_text(f"name: other-teacher\nmodel: {tmp_path}/other\nbackend: transformers\n")
    with pytest.raises(RecipeError, match=r"^recipe key 'teachers.search': student tokenizer \(.*student\) and "
                                          r"teacher tokenizer \(other-teacher\) differ: vocabulary sizes"):
        dry_run(load_recipe(mixed / "recipe.yaml", [f"teachers.search={tmp_path}/other.yaml"]))
    with pytest.raises(RecipeError, match=r"set objective.tokenizers=cross to distil across tokenizers"):
        dry_run(load_recipe(mixed / "recipe.yaml", [f"teachers.search={tmp_path}/other.yaml"]))
    assert dry_run(load_recipe(mixed / "recipe.yaml", [f"teachers.search={tmp_path}/other.yaml",
                                                       "objective.tokenizers=cross"]))["dry_run"]
    assert dry_run(mixed_recipe(mixed))["dry_run"]


def test_eval_split_is_every_env_s_held_out_split(mixed):
    """eval.split overrides each env's env.eval_split, as in a single-env run: a split of every env."""
    from turnopd.orchestration.preflight import check_setup

    setup, _ = check_setup(mixed_recipe(mixed, "eval.split=train"))
    assert {env: part.eval_split for env, part in setup.envs.items()} == {"alfworld": "train", "search": "train"}
    with pytest.raises(RecipeError, match=r"^recipe key 'eval.split': unknown search split 'valid_seen' in "):
        check_setup(mixed_recipe(mixed, "eval.split=valid_seen"))


def mixed_recipe(root: Path, *overrides: str):
    """The loop recipe with the mixture, its search teacher added (LOOP_RECIPE names the ALFWorld one)."""
    return load_recipe(root / "recipe.yaml", [f"teachers.search={root}/search_teacher.yaml", *overrides])


def action_logprobs(model, turn: Turn) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([turn.prompt_ids + turn.action_ids])).logits[0, :-1].float()
    lp = logits.log_softmax(-1)[len(turn.prompt_ids) - 1:]
    return lp.gather(1, torch.tensor(turn.action_ids)[:, None]).squeeze(1).tolist()


@pytest.mark.slow
def test_a_mixed_batch_plays_each_env_in_its_pool_and_is_scored_by_its_env_s_teacher(mixed):
    from teachers import make_teachers
    from turnopd.core.ledger import Ledger
    from turnopd.loaders.hf_models import load_student
    from turnopd.orchestration.pipeline import make_depth, open_pools, plan_step
    from turnopd.orchestration.pipeline.mixture import play_mixture
    from turnopd.orchestration.preflight import check_setup
    from turnopd.rollout import make_policy

    cfg = mixed_recipe(mixed)
    setup, _ = check_setup(cfg)
    student, tokenizer = load_student(setup.student_path, "float32", None)
    policy = make_policy(cfg.policy, student, tokenizer=tokenizer, seed=0)
    teachers = make_teachers(setup.teacher_specs)
    plan = plan_step(make_depth(cfg), 0, cfg)  # step 0: warm-up, each env at its own horizon
    assert {env: p.turn_limits for env, p in plan.envs.items()} == {"alfworld": (3, 3), "search": (2, 2)}
    with open_pools(cfg, setup) as pools:
        trajectories = play_mixture(cfg, setup, pools, policy, teachers, plan, Ledger())
    assert [t.env_name for t in trajectories] == ["alfworld"] * 2 + ["search"] * 2
    assert all(t.task_id in setup.envs[t.env_name].train_tasks for t in trajectories)
    assert max(t.depth for t in trajectories[2:]) <= 2
    for traj in trajectories:
        other = teachers["search" if traj.env_name == "alfworld" else "alfworld"]
        for turn in traj.turns:
            assert turn.teacher_logprobs == pytest.approx(action_logprobs(teachers[traj.env_name].model, turn), abs=1e-5)
            assert turn.teacher_logprobs != pytest.approx(action_logprobs(other.model, turn), abs=1e-3)


ASYNC = ("objective.clip_eps=0.2",)  # k1 on stale tokens needs its ratio clipped (recipe check)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "pool"])
def test_the_generator_plays_each_env_in_its_pool_and_scores_it_with_its_env_s_teacher(mixed, mode):
    """one_step_off and pool: the generator process plays each env's share of a MixturePlan (pool: from
    each env's own wave queue) and scores each trajectory with its env's teacher."""
    from teachers import make_teachers
    from turnopd.core.ledger import Ledger
    from turnopd.loaders.hf_models import load_student
    from turnopd.orchestration.pipeline import make_depth, open_rollouts, plan_step
    from turnopd.orchestration.preflight import check_setup
    from turnopd.trainer import Trainer

    cfg = mixed_recipe(mixed, f"pipeline.mode={mode}", *ASYNC)
    setup, _ = check_setup(cfg)
    student, _ = load_student(setup.student_path, cfg.student.dtype, cfg.student.lora)
    trainer = Trainer(student, cfg.trainer, cfg.objective, cfg.loss, cfg.trainer.steps)
    depth = make_depth(cfg)
    plan = plan_step(depth, 0, cfg)
    with open_rollouts(cfg, setup, trainer=trainer, depth=depth, ledger=Ledger(), start_step=0) as rollouts:
        trajectories = rollouts.take(plan)
        if mode == "pool":  # each env's waves queued apart: one of each (step 2 probes), its 2 episodes a step
            assert [(s.waves, s.batch, len(s.fifo)) for s in rollouts.streams.values()] == [(1, 2, 0), (1, 2, 0)]
    assert [t.env_name for t in trajectories] == ["alfworld"] * 2 + ["search"] * 2
    assert all(t.task_id in setup.envs[t.env_name].train_tasks for t in trajectories)
    assert max(t.depth for t in trajectories[2:]) <= 2  # search's horizon
    teachers = make_teachers(setup.teacher_specs)
    for traj in trajectories:
        other = teachers["search" if traj.env_name == "alfworld" else "alfworld"]
        for turn in traj.turns:
            assert turn.teacher_logprobs == pytest.approx(action_logprobs(teachers[traj.env_name].model, turn), abs=1e-5)
            assert turn.teacher_logprobs != pytest.approx(action_logprobs(other.model, turn), abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "overrides"), [("sync", ()), ("one_step_off", ASYNC), ("pool", ASYNC),
                                                 ("sync", ("objective.estimator=full",))])  # teachers in-process
def test_a_mixed_run_records_each_env_s_depth_and_evaluation(mixed, mode, overrides):
    import json

    from turnopd.orchestration.distill import run_distillation

    summary = run_distillation(mixed_recipe(mixed, "eval.teacher=true", f"pipeline.mode={mode}", *overrides))
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 2 and all(r["pipeline"]["mode"] == mode for r in train)
    # step 1 (warm-up): each env's cap its own horizon; step 2: a probe step of each env's 2 episodes
    assert [{env: f["rollout_depth_cap"] for env, f in r["per_env"].items()} for r in train] == [
        {"alfworld": 3, "search": 2}, {"alfworld": 3, "search": 2}]
    assert [r["per_env"]["search"]["probes"] for r in train] == [0, 2] and train[1]["probes"] == 4
    assert all(f["episodes"] == 2 for r in train for f in r["per_env"].values())
    assert train[1]["per_env"]["search"]["h_eff"] is not None and train[0]["per_env"]["search"]["h_eff"] is None
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    teacher = [r for r in records if r["kind"] == "teacher_eval"]  # each env's teacher on its own env
    for r in evals + teacher:
        assert set(r["per_env"]) == {"alfworld", "search"} and r["num_tasks"] == 2
        assert [e["split"] for e in r["per_env"].values()] == ["valid_seen", "test"]
        assert r["avg_at_k"] == pytest.approx(sum(e["avg_at_k"] for e in r["per_env"].values()) / 2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "pool"])
def test_a_mixed_run_ends_within_one_episode_of_its_work_budget(mixed, mode):
    """A budget of 7 env steps, a step of 2 ALFWorld episodes (horizon 3) and 2 search ones (horizon 2):
    the run stops at the step that reaches the budget, at most one episode's steps (3) past it, in
    every mode (pool's steps counted at each env's horizon: their waves were requested earlier)."""
    import json

    from turnopd.orchestration.distill import run_distillation

    summary = run_distillation(mixed_recipe(mixed, "trainer.steps=6", "trainer.budget.unit=env_steps",
                                            "trainer.budget.amount=7", f"pipeline.mode={mode}", "eval.max_tasks=1",
                                            *(ASYNC if mode != "sync" else ())))
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    spent = [r["env_steps"] for r in records if r["kind"] == "train"]
    assert 7 <= sum(spent) <= 7 + 3 and sum(spent[:-1]) < 7 and len(spent) < 6


def test_frontier_reads_the_mean_or_one_env_of_a_mixed_run(tmp_path):
    import json

    from turnopd.analysis.frontier import FrontierError, load_run
    from turnopd.rollout.eval import EvalResult

    alfworld = EvalResult("valid_unseen", 1, 0.5, {"look": 0.5}, 2, 10.0, per_task={"a1": 1.0, "a2": 0.0})
    search = EvalResult("test", 1, 0.0, {"hotpotqa": 0.0}, 1, 4.0, per_task={"s1": 0.0})
    mixed = EvalResult.mixed({"alfworld": alfworld, "search": search})
    # the envs' mean (each env weighs the same), turns over all 3 episodes: (2 * 10 + 4) / 3
    assert (mixed.avg_at_k, mixed.num_tasks, mixed.mean_turns) == (0.25, 3, 8.0)
    assert mixed.per_task == {"alfworld/a1": 1.0, "alfworld/a2": 0.0, "search/s1": 0.0}
    assert EvalResult.from_record(mixed.record()).per_env["search"].avg_at_k == 0.0
    run = tmp_path / "mixed"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0, "train_time_s": 0.0,
                                                   **mixed.record()}) + "\n")
    assert [e.avg_at_k for e in load_run(run).evals] == [0.25]
    only_alfworld = load_run(run, env="alfworld").evals[0]
    assert (only_alfworld.avg_at_k, only_alfworld.per_task) == (0.5, {"a1": 1.0, "a2": 0.0})
    with pytest.raises(FrontierError, match="has no env 'webshop'; its envs: alfworld, search"):
        load_run(run, env="webshop")
