"""Same recipes, same records: the check that a change of shape (issue 55: the core with the add-ons
at its edges) changed no behaviour. Run it in each of two checkouts (a pytest module: it builds the
tests' tiny models), then compare the two output folders:

    cp benchmarks/same_records/run_cases.py BEFORE/tests/same_records_cases.py
    (cd BEFORE && EQ_OUT=/tmp/before python -m pytest tests/same_records_cases.py -p no:cacheprovider)
    EQ_OUT=/tmp/after python -m pytest benchmarks/same_records/run_cases.py -p no:cacheprovider
    python benchmarks/same_records/compare.py /tmp/before /tmp/after

Cases: the tiny ALFWorld loop of tests/conftest.py (3 steps, a probe step) in sync and one_step_off,
with the judge (teacher_policy, k 2), the reward term and the constant loss mode; a world model
trained on it (40 steps) under the replay and twin verdicts, WMRL's isotonic map and anchor weight;
the screenshot student of tests/test_screenshots.py (2 steps). Each case's records but the start
record are written to $EQ_OUT/<case>.json, timing fields left out."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_screenshots as shots
from tests.conftest import child_env, loop_models, tiny_model_dir  # noqa: F401 (a fixture)
from tests.test_world_model_rollouts import write_world_model_recipe

OUT = Path(os.environ.get("EQ_OUT", "/tmp/eq"))
TIMING = ("time", "_s", "busy", "phases", "train_parts", "rate", "seconds", "idle", "wall", "clock")

LOOP = """
name: eq
depth: {{warmup_steps: 1, probe_every: 2, num_probes: 2, min_successes: 1}}
trainer: {{steps: 3, episodes_per_step: 4, lr: 1.0e-3}}
eval: {{max_tasks: 2}}
"""


def run(*args, env=None):
    done = subprocess.run([sys.executable, "-m", "turnopd.cli", *args], env=env or child_env(), capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def keep(record):
    return {k: v for k, v in record.items() if not any(t in k for t in TIMING)}


def save(case, run_dir):
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{case}.json").write_text(json.dumps([keep(r) for r in records if r["kind"] != "start"], indent=1))


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_model_dir):  # noqa: F811 (the fixture imported above)
    return loop_models(tmp_path_factory.mktemp("eq"), tiny_model_dir, LOOP)


@pytest.mark.parametrize("case, overrides", [
    ("sync", []),
    ("one_step_off", ["pipeline.mode=one_step_off", "objective.clip_eps=0.2"]),
    ("judge", ["judge.by=teacher_policy", "judge.k=2"]),
    ("reward", ["objective.reward_weight=0.5", "trainer.group_size=2"]),
    ("constant", ["loss.mode=constant", "loss.constant_k=2"]),
])
def test_loop(root, case, overrides):
    run("distill", str(root / "recipe.yaml"), f"name={case}", *overrides)
    save(case, root / "runs" / case)


def test_world_model(root, tiny_model_dir):  # noqa: F811
    recipe = write_world_model_recipe(root, tiny_model_dir)
    run("world-model", "train", str(recipe))
    wm = root / "world-model"
    for case, extra in [("wm_replay", ["world_model.verdict=replay", "world_model.samples=2"]),
                        ("wm_twin", ["world_model.verdict=twin", "world_model.real_fraction=0.5"]),
                        ("wm_isotonic", ["world_model.debias=isotonic"]),
                        ("wm_anchor", ["world_model.denoise=anchor_weight", "trainer.group_size=2"])]:
        run("distill", str(root / "recipe.yaml"), f"name={case}", f"world_model.path={wm}",
            "world_model.temperature=0.3", *extra)
        save(case, root / "runs" / case)


def test_screenshots(tmp_path_factory):
    from turnopd.models import vlm
    from turnopd.models.tiny import build_tiny_model
    models = tmp_path_factory.mktemp("screenshots")
    pages = vlm.play_pages("train", 2)
    vlm.build_tiny_vlm(models / "student", [p.text for p in pages], seed=0, **shots.SIZE)
    build_tiny_model(models / "teacher", tokenizer=models / "student", hidden_size=64, num_layers=1, num_heads=1,
                     max_position_embeddings=2048, seed=3)
    (models / "teacher.yaml").write_text(f"name: text-teacher\nmodel: {models / 'teacher'}\nbackend: transformers\n"
                                         "dtype: float32\nmax_length: 2048\n")
    (models / "recipe.yaml").write_text(shots.RECIPE.format(root=models))
    run("distill", str(models / "recipe.yaml"), "trainer.steps=2")
    save("screenshots", models / "runs" / "shots")
