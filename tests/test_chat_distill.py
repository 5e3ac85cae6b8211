"""The SmolLM2 chat recipe end to end on CPU (slow): `turnopd distill recipes/alfworld/smollm2_chat.yaml
trainer.steps=2` with its teacher and student prepared small (SmolLM2-135M-Instruct fine-tuned for 2 and
1 steps on 4 of the explorer's ALFWorld conversations) and short episodes: both models are built
through the recipe's own preparations, the run trains 2 steps on chat trajectories, each one
sequence, and evaluates."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.test_distill import _distill, _train_records

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SMALL_SFT = ["demos.episodes=4", "batch_turns=2"]


def test_the_smollm2_chat_recipe_distills_two_steps(tmp_path, smollm2_tokenizer_dir):
    (tmp_path / "teacher_sft.yaml").write_text(
        f"defaults: [{REPO / 'recipes/alfworld/smollm2_chat/teacher_sft.yaml'}]\n"
        "trainer: {steps: 2}\ndemos: {episodes: 4}\nbatch_turns: 2\neval: {enabled: false}\n")
    (tmp_path / "teacher.yaml").write_text(f"name: smollm2-chat-smoke\nmodel: {tmp_path / 'teacher'}\n"
                                           "backend: transformers\ndtype: float32\nmax_length: 8192\n"
                                           f"sft_recipe: {tmp_path / 'teacher_sft.yaml'}\n")
    (tmp_path / "recipe.yaml").write_text(f"defaults: [{REPO / 'recipes/alfworld/smollm2_chat.yaml'}]\n")
    student = ",".join(["trainer.steps=1", *SMALL_SFT])
    proc = _distill(tmp_path, "trainer.steps=2", "name=smoke", f"output_dir={tmp_path / 'runs'}",
                    f"teachers.alfworld={tmp_path / 'teacher.yaml'}", f"student.path={tmp_path / 'student'}",
                    f"student.prepare_options.overrides=[{student}]", "env.max_turns=3", "env.max_tasks=4",
                    "trainer.episodes_per_step=2", "eval.max_tasks=1", "policy.max_new_tokens=8", "tracking=[]")
    out, _ = proc.communicate(timeout=3000)
    assert proc.returncode == 0, out
    run = tmp_path / "runs" / "smoke"
    train = _train_records(run)
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["tokens_trained"] > 0 for r in train)
    assert "style: chat" in (run / "config.yaml").read_text()
    assert (tmp_path / "teacher" / "config.json").is_file() and (tmp_path / "student" / "config.json").is_file()
