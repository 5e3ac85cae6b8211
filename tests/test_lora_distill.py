"""LoRA distillation end to end on real ALFWorld games: a run with `student.lora` checkpoints peft
adapters, kill -9 and --resume reproduce its losses, `turnopd model merge` folds the adapter into a
plain folder with the adapter model's outputs; and the same on SmolLM2-135M."""

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import loop_models
from tests.test_distill import RECIPE, _distill, _kill_at_checkpoint, _train_records
from turnopd.cli import main

# test_distill's loop recipe with a LoRA student, 3 steps at an adapter's lr
LORA = ("student.lora.rank=8", "student.lora.alpha=16.0", "trainer.steps=3", "trainer.lr=1.0e-2")

IDS = torch.tensor([[3, 9, 14, 20, 7, 33, 41, 5]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _run(models: Path, *args: str) -> str:
    proc = _distill(models, *LORA, *args)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_merges(tmp_path_factory, tiny_model_dir):
    models = loop_models(tmp_path_factory.mktemp("lora"), tiny_model_dir, RECIPE)
    out = _run(models, "name=lora")
    run_a = models / "runs" / "lora"
    train = _train_records(run_a)
    assert [r["step"] for r in train] == [1, 2, 3]
    assert "LoRA adapter" in out  # the run says what it trains

    run_b = models / "runs" / "lora-killed"
    _kill_at_checkpoint(_distill(models, *LORA, "name=lora-killed", start_new_session=True), run_b, 1)
    assert "from step 1" in _run(models, "name=lora-killed", "--resume", str(run_b))
    train_b = _train_records(run_b)
    assert [r["step"] for r in train_b] == [1, 2, 3]
    for ra, rb in zip(train, train_b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-7)
        assert rb["tokens_generated"] == ra["tokens_generated"]

    # The checkpoint is a peft adapter over the student folder; it moved the student's outputs.
    last = run_a / "checkpoints" / "step_000003"
    assert not (last / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(models / "student", dtype=torch.float32)
    base_logits = logits(base)
    adapted = PeftModel.from_pretrained(base, last).eval()
    assert float((logits(adapted) - base_logits).abs().max()) > 1e-3

    assert main(["model", "merge", str(run_a)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(run_a / "merged", dtype=torch.float32)
    torch.testing.assert_close(logits(merged), logits(adapted), atol=1e-5, rtol=1e-5)
    assert (run_a / "merged" / "tokenizer.json").is_file()
    assert main(["model", "merge", str(models / "student")]) == 2  # a full model has no adapter to merge


SMOLLM2_RECIPE = """
output_dir: {root}/runs
name: smollm2-lora
student: {{path: ~/.cache/turnopd/models/smollm2-135m, prepare: smollm2-135m, lora: {{rank: 8, alpha: 16.0}}}}
teachers: {{alfworld: {root}/teacher.yaml}}
env: {{name: alfworld, max_turns: 2, answer_format: action, history_length: 1, num_workers: 1, max_tasks: 2,
       eval_split: valid_seen}}
policy: {{max_new_tokens: 8}}
depth: {{mode: fixed, fixed_cap: 2}}
trainer: {{steps: 2, episodes_per_step: 1, lr: 1.0e-3}}
eval: {{at_start: false, max_tasks: 1}}
tracking: []
"""


@pytest.mark.slow
def test_lora_distillation_of_smollm2(tmp_path):
    """Two LoRA steps on SmolLM2-135M (tied head), distilled from a SmolLM2 whose final norm is
    perturbed (so that the teacher differs): only the adapter is checkpointed, and it loads."""
    from turnopd.models import default_model_dir, prepare_model
    from turnopd.models.smollm2 import smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    student = prepare_model("smollm2-135m", default_model_dir("smollm2-135m"))
    teacher = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(1.2)
    teacher.save_pretrained(tmp_path / "teacher")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(student).save_pretrained(tmp_path / "teacher")
    (tmp_path / "teacher.yaml").write_text(f"name: smollm2-teacher\nmodel: {tmp_path / 'teacher'}\n"
                                           "backend: transformers\ndtype: float32\nmax_length: 8192\n")
    (tmp_path / "recipe.yaml").write_text(SMOLLM2_RECIPE.format(root=tmp_path))
    proc = _distill(tmp_path)
    out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out
    run = tmp_path / "runs" / "smollm2-lora"
    train = _train_records(run)
    assert [r["step"] for r in train] == [1, 2] and all(r["loss"] == r["loss"] for r in train)
    last = run / "checkpoints" / "step_000002"
    assert not (last / "model.safetensors").exists()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32), last)
    # rank 8 on the 7 linear layers of each of 30 blocks (hidden 576, kv 3 heads x 64 = 192, MLP 1536):
    # q, o 8 x (576 + 576); k, v 8 x (576 + 192); gate, up, down 8 x (576 + 1536); the tied head has none
    per_block = 2 * 8 * (576 + 576) + 2 * 8 * (576 + 192) + 3 * 8 * (576 + 1536)
    lora = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n)
    assert lora == 30 * per_block == 2_442_240
    assert (last / "adapter_model.safetensors").stat().st_size == pytest.approx(4 * lora, rel=0.01)  # fp32
