"""Tiny models: lossless tokenizer, chat template, HF-format save/load, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.base import extract_action, format_answer
from tests.conftest import TINY_CORPUS, TINY_MODEL_SIZE
from turnopd.models.tiny import TAG_TOKENS, build_tiny_model

ENV_LIKE = [
    "go to desk 1",
    "move pencil 1 to desk 2",
    "take alarmclock 3 from sidetable 12",
    "heat egg 1 with microwave 1",
    "look",
    "You arrive at countertop 3. On the countertop 3, you see a butterknife 2, and a saltshaker 1.",
    # words and characters the corpus never had: BPE falls back to bytes
    "search[3 ounce bottle of bright citrus deodorant for sensitive skin, price < 50.00 dollars]",
    "click[Buy Now]  \n\tnaïve café – 東京 🙂",
    "",
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("text", ENV_LIKE)
def test_any_text_round_trips_exactly(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("action", ENV_LIKE[:7])
@pytest.mark.parametrize("answer_format", ["action", "think_action"])
def test_generated_answer_decodes_to_the_action_the_env_receives(tok, action: str, answer_format: str) -> None:
    answer = format_answer(action, answer_format, thought="I need the pencil first.")
    ids = tok.encode(answer, add_special_tokens=False)
    assert extract_action(tok.decode(ids)).action == action


def test_agent_tags_are_single_tokens(tok) -> None:
    for tag in TAG_TOKENS:
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == tag
    ids = tok.encode("<action>look</action>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<action>")
    assert ids[-1] == tok.convert_tokens_to_ids("</action>")


def test_frequent_corpus_words_are_whole_tokens(tok) -> None:
    # "desk" occurs many times in the corpus, after a space: BPE merges it into one token.
    assert len(tok.encode(" desk", add_special_tokens=False)) == 1
    assert len(tok.encode(" xylophone", add_special_tokens=False)) > 1


def test_chat_template_is_chatml_and_prefix_consistent(tok) -> None:
    messages = [{"role": "user", "content": "Your task is to: put some pencil on desk."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nYour task is to: put some pencil on desk.<|im_end|>\n<|im_start|>assistant\n"
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    answer = "<action>go to desk 1</action>"
    answer_ids = tok.encode(answer, add_special_tokens=False)
    # The tokens a student generates after the prompt are the tokens of the answer alone.
    assert prompt_ids + answer_ids == tok.encode(text + answer, add_special_tokens=False)
    assert prompt_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_saved_model_loads_and_matches_its_config(tiny_model_dir: Path, tok) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.vocab_size == len(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 2)
    assert cfg.intermediate_size == 4 * 64
    assert cfg.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert (tiny_model_dir / "tokenizer.json").is_file()
    n_params = sum(p.numel() for p in model.parameters())
    assert json.loads((tiny_model_dir / "turnopd_build.json").read_text())["parameters"] == n_params
    ids = torch.tensor([tok.encode("go to desk 1", add_special_tokens=False)])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_same_texts_and_seed_give_identical_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again", TINY_CORPUS, seed=0, **TINY_MODEL_SIZE)
    assert _file_bytes(again) == _file_bytes(tiny_model_dir)
    other_seed = _file_bytes(build_tiny_model(tmp_path / "seed1", TINY_CORPUS, seed=1, **TINY_MODEL_SIZE))
    assert other_seed["tokenizer.json"] == _file_bytes(tiny_model_dir)["tokenizer.json"]
    assert other_seed["model.safetensors"] != _file_bytes(tiny_model_dir)["model.safetensors"]


def test_build_replaces_an_existing_folder_and_leaves_no_temporaries(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    build_tiny_model(out, TINY_CORPUS, **TINY_MODEL_SIZE)
    assert not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_qwen2_arch_and_tied_embeddings(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "q", TINY_CORPUS, arch="qwen2", tie_word_embeddings=True, **TINY_MODEL_SIZE)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"arch": "gpt9"}, "unknown tiny-model arch"),
    ({"hidden_size": 30, "num_heads": 4}, "not divisible"),
    ({"hidden_size": 64, "num_heads": 4}, "head size hidden_size/num_heads = 16"),
])
def test_bad_options_fail_before_building(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tiny_model(tmp_path / "bad", TINY_CORPUS, **kwargs)
    assert not (tmp_path / "bad").exists()


def test_needs_exactly_one_of_texts_or_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="either texts"):
        build_tiny_model(tmp_path / "none", [])
    with pytest.raises(ValueError, match="either texts"):
        build_tiny_model(tmp_path / "both", TINY_CORPUS, tokenizer=tiny_model_dir)


def test_reused_tokenizer_is_the_same_tokenizer(tmp_path: Path, tiny_model_dir: Path, tok) -> None:
    out = build_tiny_model(tmp_path / "student", tokenizer=tiny_model_dir, hidden_size=32, num_heads=1,
                           num_layers=1, max_position_embeddings=512)
    student_tok = AutoTokenizer.from_pretrained(out)
    assert student_tok.get_vocab() == tok.get_vocab()
    text = "<action>take pencil 1 from desk 1</action> ünïcode"
    assert student_tok.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert student_tok.chat_template == tok.chat_template and student_tok.model_max_length == 512
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tok) and model.config.hidden_size == 32
