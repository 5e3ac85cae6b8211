"""An autoresearch world model (slow): trained for a few steps on a few real transitions (every step
a real training job), its held-out fidelity report grades the metric it predicts; the job model
(kind job_model) built from real labelled changes and graded the same way; and on the autoresearch
env, the outcome-reward term, WMRL's corrections (with the job model too) and each judge mode
(turnopd.rollout.judge) run 2 real distillation steps."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import envs.demonstrations
from tests.conftest import TINY_MODEL_SIZE, child_env
from turnopd.core.metrics import read_metrics
from turnopd.orchestration.world_model_training import (
    load_world_model_recipe,
    run_world_model_eval,
    run_world_model_train,
)

pytestmark = pytest.mark.slow


ENV = {"name": "autoresearch", "max_turns": 2, "num_workers": 1, "answer_format": "action", "history_length": 1,
       "eval_split": "test", "options": {"disk_cache": True}}
# a second turn's prompt holds the first turn's observation: ~1,100 tokens of the env's own tokenizer
MODEL_SIZE = {**TINY_MODEL_SIZE, "max_position_embeddings": 2048}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Its own demonstrations and job results (2-turn expert episodes on 2 train tasks and 1 test
    task), a tiny model with the env's tokenizer, a world model trained from it for 4 steps, and the
    distillation recipe of `distill`: (root, the train result)."""
    root = tmp_path_factory.mktemp("wm-autoresearch")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TURNOPD_CACHE", str(root / "cache"))
        patch.setattr(envs.demonstrations, "DEMOS_DIR", root / "demos")
        recipe = root / "world_model.yaml"
        recipe.write_text(yaml.safe_dump({
            "name": "wm-autoresearch-smoke", "env": ENV,
            "model": {"path": str(root / "wm-init"), "prepare": "tiny",
                      "prepare_options": {"env": ENV, "corpus_episodes": 2, **MODEL_SIZE}},
            "data": {"expert_episodes": 2, "held_out_episodes": 1},
            "metric_samples": 2, "batch_turns": 4, "trainer": {"steps": 4, "lr": 3.0e-3},
            "output_dir": str(root / "world-model"),
        }))
        result = run_world_model_train(load_world_model_recipe(str(recipe)))
        # the job model (kind job_model) on the digits tasks: 1 walk of 2 changes from each start
        job_recipe = root / "world_model_job.yaml"
        job_recipe.write_text(yaml.safe_dump({
            "name": "job-model-smoke", "kind": "job_model", "env": {**ENV, "task_types": ["digits"]},
            "job_model": {"walks_per_task": 1, "walk_turns": 2, "members": 2, "hidden": 8, "steps": 50},
            "data": {"held_out_episodes": 1}, "metric_samples": 2, "output_dir": str(root / "job-model")}))
        run_world_model_train(load_world_model_recipe(str(job_recipe)))
    (root / "teacher.yaml").write_text(f"name: tiny\nmodel: {root / 'wm-init'}\nbackend: transformers\n"
                                       "dtype: float32\nmax_length: 2048\n")
    (root / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "ar", "output_dir": str(root / "runs"), "env": ENV, "student": {"path": str(root / "wm-init")},
        "teachers": {"autoresearch": str(root / "teacher.yaml")}, "policy": {"max_new_tokens": 8},
        "depth": {"warmup_steps": 1, "probe_every": 2, "num_probes": 1, "min_successes": 1},
        "trainer": {"steps": 2, "episodes_per_step": 4, "lr": 1.0e-3},
        "eval": {"max_tasks": 1, "at_start": False}, "tracking": []}))
    return root, result


def test_an_autoresearch_world_model_is_graded_on_the_metric(world, capsys, monkeypatch):
    root, result = world
    assert result.metric is not None and list(result.metric) == ["all", "source=expert"]
    row = result.metric["all"]
    # the expert's 2 moves on the test task each ran a job, and it plays only changes the env keeps
    assert row.changes == 2 and row.helped == 2 and row.helps_auroc is None
    assert 0 <= row.parsed <= row.changes and (row.metric_mae is None) == (row.parsed == 0)
    assert 0.0 <= row.helps_ece <= 1.0
    meta = json.loads((root / "world-model" / "world_model.json").read_text())
    assert meta["env"] == "autoresearch" and meta["result"]["metric"]["all"]["changes"] == 2
    monkeypatch.setenv("TURNOPD_CACHE", str(root / "cache"))
    again = run_world_model_eval(load_world_model_recipe(str(root / "world_model.yaml")))  # graded again
    assert "held-out scored changes" in capsys.readouterr().out
    assert again.metric is not None and again.metric["all"].changes == 2


def test_a_job_model_is_an_answerer_graded_on_the_same_tables(world):
    root, _ = world
    meta = json.loads((root / "job-model" / "world_model.json").read_text())
    assert meta["kind"] == "answerer" and meta["env"] == "autoresearch"
    result = meta["result"]
    # 10 digits train tasks: 1 walk of 2 changes each, plus the memo's known neighbours of their states
    assert result["train_transitions"]["changes"] >= 20
    assert result["metric"]["all"]["changes"] == 2 and result["metric"]["all"]["parsed"] == 2  # it always writes one
    assert result["replay"]["all"]["no_verdict"] == 0


def distill(root: Path, name: str, *overrides: str) -> list[dict]:
    """2 real steps of 4 two-turn autoresearch episodes (the fixture's recipe.yaml: student and teacher
    the world model's tiny base, with the env's tokenizer); the train records."""
    done = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(root / "recipe.yaml"), f"name={name}",
                           *overrides], env=child_env(TURNOPD_CACHE=str(root / "cache")), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return [r for r in read_metrics(root / "runs" / name / "metrics.jsonl") if r.get("kind") == "train"]


@pytest.mark.parametrize("name, overrides", [
    ("reward", ["objective.estimator=k1", "objective.reward_weight=0.5", "trainer.group_size=2"]),
    ("isotonic", ["world_model.debias=isotonic"]),
    ("anchor_weight", ["world_model.denoise=anchor_weight", "trainer.group_size=2"]),
])
def test_the_reward_term_and_wmrl_corrections_run_two_steps_on_autoresearch(world, name, overrides):
    root, _ = world
    uses_world_model = name != "reward"
    train = distill(root, name, *overrides,
                    *([f"world_model.path={root / 'world-model'}", "world_model.temperature=0.3"] if uses_world_model else []))
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in train)
    if name == "reward":  # no world model: every episode real
        assert all(r.get("world_model_episodes") is None for r in train)
    if name == "isotonic":  # fewer than 200 pairs: the map is still the identity, and said so
        assert all(r["world_model_calibrated"] is False for r in train)
    if name == "anchor_weight":  # 2 groups a step: at least 1 anchor group, weight 1 before 32 groups
        assert all(r["world_model_anchor_groups"] >= 1 and r["world_model_anchor_weight"] == 1.0 for r in train)


def test_the_job_model_plays_model_episodes_under_wmrls_corrections(world):
    """The frontier's WMRL arm (recipes/methods/vanilla_opd_world_model_wmrl.yaml) at a schedule scaled
    to 2 steps: one anchor group of 2 real episodes a step, the other group played by the job model,
    each real episode graded by the model's replay of its actions."""
    root, _ = world
    train = distill(root, "job-model-wmrl", f"world_model.path={root / 'job-model'}", "world_model.debias=isotonic",
                    "world_model.denoise=anchor_weight", "world_model.verdict=replay", "world_model.samples=2",
                    "world_model.temperature=0.5", "objective.estimator=k1", "objective.reward_weight=0.5",
                    "trainer.group_size=2", "world_model.calibration_min_pairs=2", "world_model.calibration_refit_every=1",
                    "world_model.anchor_warmup_groups=1", "depth.mode=full")
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in train)
    for r in train:
        assert r["world_model_anchor_groups"] == 1 and r["world_model_episodes"] == 2
        assert r["world_model_steps"] >= 2 and r["world_model_verdict_steps"] >= 2  # 2 replays of >= 1 step
        assert r["env_steps"] <= 2 * 2  # the anchor group's 2 two-turn episodes


@pytest.mark.parametrize("by, memory", [("teacher", "none"), ("teacher", "focused"), ("teacher", "full"),
                                        ("teacher", "summary"), ("teacher_policy", "none"), ("world_model", "none")])
def test_each_judge_mode_runs_two_steps_on_autoresearch(world, by, memory):
    """k = 3 candidates a turn; the judge's counts are in each step's record, and the memory file holds
    exactly the attempts of the steps' real episodes (those whose answer reported a metric)."""
    root, _ = world
    name = f"judge-{by}-{memory}"
    train = distill(root, name, f"judge.by={by}", f"judge.memory={memory}", "judge.k=3",
                    *([f"world_model.path={root / 'world-model'}", "world_model.real_fraction=1"]
                      if by == "world_model" else []))
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in train)
    for r in train:
        stats = r["pipeline"]["judge"]
        assert set(stats) == {"turns", "pairs", "verdicts", "overrides"}
        assert 0 <= stats["verdicts"] <= stats["pairs"] and stats["overrides"] <= stats["turns"] <= 4 * 2
        assert stats["pairs"] >= stats["turns"]  # a judged turn has 2 or 3 distinct candidates: 1 or 3 pairs
    memory_file = root / "runs" / name / "judge_memory.jsonl"
    attempts = [json.loads(line) for line in memory_file.read_text().splitlines()] if memory_file.exists() else []
    assert all(a["task_id"].startswith(("digits", "spirals")) and a["order"][0] in (0, 1) for a in attempts)
