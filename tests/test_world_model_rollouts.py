"""World models on real ALFWorld games (slow): `turnopd world-model train` writes a Hugging Face model
and its fidelity table; distillation with `world_model.path` plays most episodes in it, and with
real_fraction 1 it reproduces the plain run's losses; WMRL's corrections (world_model.debias isotonic,
world_model.denoise anchor_weight) and the outcome-reward term each run 2 real steps with it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import TINY_MODEL_SIZE, child_env, loop_models
from turnopd.core.metrics import read_metrics
from turnopd.orchestration.world_model_training import load_world_model_recipe

pytestmark = pytest.mark.slow

RECIPE = """
name: loop
depth: {{warmup_steps: 1, probe_every: 2, num_probes: 1, min_successes: 1}}
trainer: {{steps: 2, episodes_per_step: 4, lr: 1.0e-3}}
eval: {{max_tasks: 1, at_start: false}}
"""


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "turnopd.cli", *args], env=child_env(), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def write_world_model_recipe(root: Path, tiny_model_dir: Path) -> Path:
    """root/world_model.yaml: a world model of the loop's games, trained for 40 steps on 3 expert and 2
    episodes of root/student, written to root/world-model."""
    recipe = root / "world_model.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "wm-smoke",
        "env": {"name": "alfworld", "task_types": ["look_at_obj_in_light"], "max_turns": 8, "num_workers": 1,
                "answer_format": "action", "history_length": 1, "eval_split": "valid_seen"},
        "model": {"path": str(root / "wm-init"), "prepare": "tiny",
                  "prepare_options": {"tokenizer": str(tiny_model_dir), **TINY_MODEL_SIZE}},
        "data": {"expert_episodes": 3, "student": {"path": str(root / "student")}, "student_episodes": 2,
                 "held_out_episodes": 2},
        "max_observation_tokens": 48, "batch_turns": 8, "policy": {"max_new_tokens": 6},
        "trainer": {"steps": 40, "lr": 3.0e-3}, "output_dir": str(root / "world-model"),
    }))
    return recipe


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """The loop's models, and a world model trained on a few expert and student episodes of them."""
    root = loop_models(tmp_path_factory.mktemp("wm"), tiny_model_dir, RECIPE)
    recipe = write_world_model_recipe(root, tiny_model_dir)
    out = _run("world-model", "train", str(recipe))
    assert "held-out fidelity on valid_seen" in out
    return root, root / "world-model"


def test_world_model_train_writes_the_model_and_its_fidelity_table(world):
    root, wm = world
    meta = json.loads((wm / "world_model.json").read_text())
    assert (meta["env"], meta["history_length"], meta["max_observation_tokens"]) == ("alfworld", 1, 48)
    result = meta["result"]
    assert result["train_transitions"]["expert"] > 0 and result["train_transitions"]["student"] > 0
    assert result["steps"] == 40 and result["final_loss"] < result["first_loss"]
    table = result["fidelity"]
    # every held-out transition is in "all", and in exactly one source and one verb row
    n = table["all"]["transitions"]
    assert n == sum(row["transitions"] for key, row in table.items() if key.startswith("source="))
    assert n == sum(row["transitions"] for key, row in table.items() if key.startswith("verb="))
    assert set(k for k in table if k.startswith("source=")) == {"source=expert", "source=student"}
    for row in table.values():  # an exact match has token-F1 1, so the mean F1 is at least the exact share
        assert 0.0 <= row["exact_match"] <= row["token_f1"] + 1e-9 and row["token_f1"] <= 1.0
        assert 0.0 <= row["status_accuracy"] <= 1.0
    assert 0.0 <= table["all"]["done_ece"] <= 1.0
    assert all(row["done_ece"] is None for key, row in table.items() if key.startswith("verb="))
    # every held-out episode replayed: 2 expert and 2 student episodes, each ending once in the env
    replay = result["replay"]
    assert replay["all"]["episodes"] + replay["all"]["no_verdict"] == 4
    assert sum(row["episodes"] + row["no_verdict"] for key, row in replay.items() if key != "all") == 4
    ends = sum(t["transitions"] for key, t in table.items() if key.startswith("source="))
    assert replay["all"]["turns_real"] * replay["all"]["episodes"] <= ends
    for row in replay.values():
        if row["episodes"]:
            assert 0.0 <= min(row["won_real"], row["won_replayed"], row["same_ending"]) <= 1.0
            assert 1.0 <= row["turns_replayed"] <= 8  # at most the episode's actions (max_turns 8)
    model = AutoModelForCausalLM.from_pretrained(wm)
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(wm))
    cfg = load_world_model_recipe(str(root / "world_model.yaml"))
    assert cfg.data.student is not None


def test_world_model_eval_measures_the_trained_model_again_without_training(world, tmp_path):
    root, wm = world
    before = json.loads((wm / "world_model.json").read_text())["result"]
    out = _run("world-model", "eval", str(root / "world_model.yaml"))
    assert "held-out episodes replayed in the model" in out
    after = json.loads((wm / "world_model.json").read_text())["result"]
    # the training record is kept; the held-out tables are measured again, on the same episodes
    for key in ("train_transitions", "steps", "first_loss", "final_loss", "train_time_s"):
        assert after[key] == before[key]
    assert after["fidelity"]["all"]["transitions"] == before["fidelity"]["all"]["transitions"]
    assert after["replay"]["all"]["episodes"] + after["replay"]["all"]["no_verdict"] == 4
    done = subprocess.run([sys.executable, "-m", "turnopd.cli", "world-model", "eval", str(root / "world_model.yaml"),
                           f"output_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and f"{tmp_path}/world_model.json not found: train the world model first" in done.stderr


def _train(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]


def test_distillation_plays_most_episodes_in_the_world_model_and_real_fraction_1_changes_nothing(world):
    root, wm = world
    recipe = str(root / "recipe.yaml")
    _run("distill", recipe, "name=plain")
    _run("distill", recipe, "name=all-real", f"world_model.path={wm}", "world_model.real_fraction=1.0",
         "world_model.samples=2")
    checked = _run("distill", recipe, "--dry-run", f"world_model.path={wm}")
    assert f"world model: {wm} (held-out status accuracy" in checked
    # a cool sampling temperature: 40 steps taught this model the status line, not much of the text
    _run("distill", recipe, "name=mostly-model", f"world_model.path={wm}", "world_model.real_fraction=0.3",
         "world_model.samples=2", "world_model.temperature=0.3", "world_model.verdict=replay")
    _run("distill", recipe, "name=twin", f"world_model.path={wm}", "world_model.real_fraction=0.5",
         "world_model.temperature=0.3", "world_model.verdict=twin")
    plain, all_real, mostly, twin = (_train(root / "runs" / name)
                                     for name in ("plain", "all-real", "mostly-model", "twin"))
    # every episode real: the same episodes, the same losses (denoising weights all 1), to the tolerance
    # of tests/test_distill.py's same-steps check (generation batches requests as they come, and the
    # world model's verdicts change when they come: padding moves the log-probs in the 7th digit)
    for a, b in zip(plain, all_real, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["tokens_generated"] == a["tokens_generated"] and b["world_model_episodes"] == 0
        assert b["env_steps"] == a["env_steps"] and b["world_model_steps"] == 0
        assert b["success_rate_real"] == a["success_rate"]
    # the world model answered most non-probe episodes' steps, and its time is its own
    assert sum(r["world_model_episodes"] for r in mostly) >= 2
    # some of them played on (an answer without a status line would have ended one as failed-by-env)
    assert sum(r["env_failures"] for r in mostly) < sum(r["world_model_episodes"] for r in mostly)
    assert sum(r["busy"].get("world_model", 0.0) for r in mostly) > 0
    for r in mostly:  # env_steps are the real env's turns, the model's are its own
        assert r["env_steps"] + r["world_model_steps"] == round(r["mean_turns"] * r["episodes"])
    assert sum(r["world_model_steps"] for r in mostly) > 0
    assert all(math.isfinite(r["loss"]) for r in mostly)
    debiased = [r for r in mostly if r["success_rate_debiased"] is not None]
    assert debiased and all(0.0 <= r["success_rate_debiased"] <= 1.0 for r in debiased)
    # the last-turn verdict (the default): one model step for each real episode
    for r in all_real:
        assert r["world_model_verdict_steps"] == r["episodes"] - r["env_failures"] - r["world_model_no_verdict"]
    # replay verdicts play each real episode's actions in the model alongside it: at most its turns
    assert all(r["world_model_verdict_steps"] <= r["env_steps"] for r in mostly)
    assert sum(r["world_model_verdict_steps"] for r in mostly) > sum(r["episodes"] - r["world_model_episodes"]
                                                                    for r in mostly) / 2
    # twin verdicts: each judged real episode's twin is a model episode of its task, at most its turns
    for r in twin:
        judged = r["episodes"] - r["world_model_episodes"] - r["env_failures"] - r["world_model_no_verdict"]
        assert judged <= r["world_model_verdict_steps"] <= 3 * (judged + r["world_model_no_verdict"])
    assert any(r["world_model_bias"] is not None for r in twin)


@pytest.mark.parametrize("name, overrides", [
    ("isotonic", ["world_model.debias=isotonic"]),
    ("anchor_weight", ["world_model.denoise=anchor_weight", "trainer.group_size=2"]),
    ("reward", ["objective.reward_weight=0.5", "trainer.group_size=2", "world_model.real_fraction=0.5"]),
])
def test_wmrl_corrections_and_the_reward_term_run_two_steps_with_world_model_rollouts(world, name, overrides):
    root, wm = world
    _run("distill", str(root / "recipe.yaml"), f"name={name}", f"world_model.path={wm}",
         "world_model.temperature=0.3", *overrides)
    train = _train(root / "runs" / name)
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in train)
    if name == "isotonic":  # fewer than 200 pairs: the map is still the identity, and said so
        assert all(r["world_model_calibrated"] is False and r["world_model_bias_before"] is None for r in train)
    else:
        assert all(r.get("world_model_calibrated") is None for r in train)
    if name == "anchor_weight":  # 4 episodes a step: 2 groups, round(0.2) -> at least 1 anchor group a step
        assert all(r["world_model_anchor_groups"] >= 1 and r["world_model_anchor_weight"] == 1.0 for r in train)
        # a step's groups play one source each: its model episodes are a multiple of the group size
        assert all(r["world_model_episodes"] % 2 == 0 for r in train)
    else:
        assert all(r.get("world_model_anchor_weight") is None for r in train)
