"""`prepare_model` / `turnopd model prepare`: idempotent, never overwrites, SmolLM2 from its GGUF."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnopd.cli import main
from turnopd.models import BUILD_INFO, ModelPrepareError, prepare_model, weights_fingerprint

STUDENT_SIZE = {"hidden_size": 32, "num_heads": 1, "num_layers": 1, "max_position_embeddings": 512}


def test_prepare_builds_once_then_finds_the_folder(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "student"
    assert prepare_model("tiny", out, tokenizer=str(tiny_model_dir), **STUDENT_SIZE) == out
    info = json.loads((out / BUILD_INFO).read_text())
    assert info["prepare"] == {"name": "tiny", "options": {"tokenizer": str(tiny_model_dir), **STUDENT_SIZE}}
    weights = (out / "model.safetensors").stat().st_mtime_ns
    assert prepare_model("tiny", out, tokenizer=str(tiny_model_dir), **STUDENT_SIZE) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == weights  # not rebuilt


def test_prepare_refuses_other_options_and_foreign_folders(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "student"
    prepare_model("tiny", out, tokenizer=str(tiny_model_dir), **STUDENT_SIZE)
    with pytest.raises(ModelPrepareError, match="was prepared as"):
        prepare_model("tiny", out, tokenizer=str(tiny_model_dir), **{**STUDENT_SIZE, "num_layers": 2})
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    with pytest.raises(ModelPrepareError, match="not a model"):
        prepare_model("tiny", foreign, tokenizer=str(tiny_model_dir))
    assert (foreign / "config.json").read_text() == "{}"


def test_unknown_preparation(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="smollm2-135m"):
        prepare_model("gpt5", tmp_path / "x")
    assert main(["model", "prepare", "gpt5", "--out", str(tmp_path / "x")]) == 2


def test_cli_prepares_a_student_sharing_the_teachers_tokenizer(tmp_path: Path, tiny_model_dir: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "student"
    args = ["model", "prepare", "tiny", "--out", str(out), "--tokenizer", str(tiny_model_dir),
            "--hidden-size", "32", "--num-heads", "1", "--num-layers", "1"]
    assert main(args) == 0
    assert f"tiny ready in {out}" in capsys.readouterr().out
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
    assert main(args) == 0  # idempotent
    assert main([*args[:-1], "2"]) == 2  # other options: refused, not overwritten
    assert "was prepared as" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_prepare_from_the_gguf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gguf")
    from turnopd.models.smollm2 import smollm2_gguf

    try:
        smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "smollm2"
    assert main(["model", "prepare", "smollm2-135m", "--out", str(out)]) == 0
    assert f"smollm2-135m ready in {out}" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.num_parameters() == 134_515_008
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok) == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.model_max_length == model.config.max_position_embeddings == 8192
    assert main(["model", "prepare", "smollm2-135m", "--out", str(out)]) == 0  # found, not rebuilt


def test_weights_fingerprint_hashes_the_weight_files_only(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model-2.safetensors").write_bytes(b"second")
    (model / "model-1.safetensors").write_bytes(b"first")
    (model / "adapter.bin").write_bytes(b"\x00\x01")
    (model / "config.json").write_text("{}")
    # by hand: each weight file's name, a NUL and its bytes, in name order; 16 hex digits
    expected = hashlib.sha256(b"adapter.bin\x00\x00\x01" b"model-1.safetensors\x00first"
                              b"model-2.safetensors\x00second").hexdigest()[:16]
    assert weights_fingerprint(model) == expected
    (model / "config.json").write_text('{"changed": true}')  # not weights
    assert weights_fingerprint(model) == expected
    (model / "model-2.safetensors").write_bytes(b"secone")
    assert weights_fingerprint(model) != expected
    assert weights_fingerprint("Qwen/Qwen3-1.7B") is None  # a hub name
    assert weights_fingerprint(tmp_path) is None  # no weight files
