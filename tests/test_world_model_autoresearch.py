"""An autoresearch world model (slow): trained for a few steps on a few real transitions (every step
a real training job), its held-out fidelity report grades the metric it predicts."""

from __future__ import annotations

import json

import pytest
import yaml

import envs.demonstrations
from tests.conftest import TINY_MODEL_SIZE
from turnopd.orchestration.world_model_training import (
    load_world_model_recipe,
    run_world_model_eval,
    run_world_model_train,
)

pytestmark = pytest.mark.slow


def test_an_autoresearch_world_model_is_graded_on_the_metric(tmp_path, monkeypatch, capsys):
    # its own demonstrations and job results: 2-turn expert episodes on 2 train tasks and 1 test task
    monkeypatch.setenv("TURNOPD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(envs.demonstrations, "DEMOS_DIR", tmp_path / "demos")
    env = {"name": "autoresearch", "max_turns": 2, "num_workers": 1, "answer_format": "action", "history_length": 1,
           "eval_split": "test", "options": {"disk_cache": True}}
    recipe = tmp_path / "world_model.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "wm-autoresearch-smoke", "env": env,
        "model": {"path": str(tmp_path / "wm-init"), "prepare": "tiny",
                  "prepare_options": {"env": env, "corpus_episodes": 2, **TINY_MODEL_SIZE}},
        "data": {"expert_episodes": 2, "held_out_episodes": 1},
        "metric_samples": 2, "batch_turns": 4, "trainer": {"steps": 4, "lr": 3.0e-3},
        "output_dir": str(tmp_path / "world-model"),
    }))
    result = run_world_model_train(load_world_model_recipe(str(recipe)))
    assert "held-out scored changes" in capsys.readouterr().out
    assert result.metric is not None and list(result.metric) == ["all", "source=expert"]
    row = result.metric["all"]
    # the expert's 2 moves on the test task each ran a job, and it plays only changes the env keeps
    assert row.changes == 2 and row.helped == 2 and row.helps_auroc is None
    assert 0 <= row.parsed <= row.changes and (row.metric_mae is None) == (row.parsed == 0)
    assert 0.0 <= row.helps_ece <= 1.0
    meta = json.loads((tmp_path / "world-model" / "world_model.json").read_text())
    assert meta["env"] == "autoresearch" and meta["result"]["metric"]["all"]["changes"] == 2
    again = run_world_model_eval(load_world_model_recipe(str(recipe)))  # the same held-out steps, graded again
    assert again.metric is not None and again.metric["all"].changes == 2
