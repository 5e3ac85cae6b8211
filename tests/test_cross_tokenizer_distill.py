"""The cross-tokenizer recipe end to end on CPU (slow): `turnopd distill recipes/alfworld/cross_tokenizer.yaml
trainer.steps=2` with small models in place of its own: a tiny student with the tests' byte-level BPE
(386 ids) and a tiny random teacher with SmolLM2-135M's real tokenizer and ChatML template (49,152
ids). The run trains 2 steps on turns the teacher read in its own tokens and evaluates; the same
recipe with objective.tokenizers=match is refused by the dry run, in one line, from the tokenizer
files alone; and the same 2 steps with the teacher's top-k across vocabularies (topk_cross)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL_SIZE, child_env
from tests.test_distill import _distill, _train_records

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _small_run(tmp_path, tiny_model_dir, smollm2_tiny_model_dir) -> list[str]:
    """The tiny student, the SmolLM2-tokenizer teacher's spec, the recipe; the overrides of a small run."""
    from turnopd.models.tiny import build_tiny_model

    build_tiny_model(tmp_path / "student", tokenizer=tiny_model_dir, **TINY_MODEL_SIZE, seed=7)
    (tmp_path / "teacher.yaml").write_text(f"name: smollm2-tokenizer-tiny\nmodel: {smollm2_tiny_model_dir}\n"
                                           "backend: transformers\ndtype: float32\nmax_length: 4096\n")
    (tmp_path / "recipe.yaml").write_text(f"defaults: [{REPO / 'recipes/alfworld/cross_tokenizer.yaml'}]\n")
    return [f"output_dir={tmp_path / 'runs'}", f"teachers.alfworld={tmp_path / 'teacher.yaml'}",
            f"student.path={tmp_path / 'student'}", "env.max_turns=3", "env.max_tasks=4",
            "trainer.episodes_per_step=2", "eval.max_tasks=1", "policy.max_new_tokens=8", "tracking=[]"]


def _two_steps(tmp_path, *overrides: str) -> str:
    """Run 2 steps named `smoke`; check their records; return the run's config."""
    proc = _distill(tmp_path, "trainer.steps=2", "name=smoke", *overrides)
    out, _ = proc.communicate(timeout=3000)
    assert proc.returncode == 0, out
    run = tmp_path / "runs" / "smoke"
    train = _train_records(run)
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["tokens_trained"] > 0 and r["turn_kl_profile"] for r in train)
    return (run / "config.yaml").read_text()


def test_the_cross_tokenizer_recipe_distills_two_steps(tmp_path, tiny_model_dir, smollm2_tiny_model_dir):
    small = _small_run(tmp_path, tiny_model_dir, smollm2_tiny_model_dir)
    refused = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(tmp_path / "recipe.yaml"),
                              "--dry-run", "objective.tokenizers=match", *small], env=child_env(),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr + refused.stdout
    assert ("differ: vocabulary sizes 386 vs 49152" in refused.stderr
            and "set objective.tokenizers=cross" in refused.stderr), refused.stderr
    assert "tokenizers: cross" in _two_steps(tmp_path, *small)


def test_the_teacher_s_top_k_across_vocabularies_distills_two_steps(tmp_path, tiny_model_dir, smollm2_tiny_model_dir):
    """topk_cross: the teacher's top-5 over its 49,152 ids, mapped to the student's 386."""
    small = _small_run(tmp_path, tiny_model_dir, smollm2_tiny_model_dir)
    config = _two_steps(tmp_path, *small, "objective.estimator=topk_cross", "objective.topk=5")
    assert "estimator: topk_cross" in config and "tokenizers: cross" in config
