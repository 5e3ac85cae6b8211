"""The prompts env (one-turn episodes from JSONL files) and the inline env pool it runs in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from envs import make_env_spec
from envs.pool import EnvPool, InlineWorkers
from envs.prompts.spec import given_answer
from tests.conftest import child_env
from turnopd.config import EnvConfig
from turnopd.core.metrics import read_metrics

LINES = [
    {"prompt": "What is 2 + 3?", "answer": "5", "type": "math"},
    {"prompt": "Name the capital of France.", "answer": "Paris"},
    {"prompt": "Write a haiku about rain."},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def spec(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", LINES)
    test = write_jsonl(tmp_path / "test.jsonl", [{"prompt": "Say hi.", "id": "greeting", "answer": "hi"}])
    return make_env_spec(EnvConfig(name="prompts", max_turns=1, pool="inline",
                                   options={"files": {"train": str(train), "test": str(test)}}))


def test_splits_ids_and_types(spec):
    assert spec.splits() == ["train", "test"]
    assert spec.tasks("train") == ["train/0", "train/1", "train/2"]  # '<split>/<line>' without an id
    assert spec.tasks("test") == ["greeting"]
    assert [spec.task_type(t) for t in spec.tasks("train")] == ["math", "prompt", "prompt"]
    with pytest.raises(ValueError, match="unknown prompts split 'valid'"):
        spec.tasks("valid")


def test_an_episode_is_one_turn_won_on_the_answer(spec):
    env = spec.make()
    start = env.reset("train/0")
    assert (start.observation, start.info["task"], start.done) == ("What is 2 + 3?", "What is 2 + 3?", False)
    assert spec.render_prompt(SimpleNamespace(observation=start.observation)) == "What is 2 + 3?"  # verbatim
    end = env.step(spec.parse_action("<think>2 + 3 is five</think><action> 5 </action>").action)
    assert (end.done, end.won, end.reward) == (True, True, 1.0)
    env.reset("train/1")
    assert env.step("  paris ").won  # case and spacing aside
    env.reset("train/1")
    assert not env.step("Lyon").won
    with pytest.raises(RuntimeError, match="step before reset"):  # the episode has ended
        env.step("Paris")
    env.reset("train/2")  # no answer: nothing to win, reward 0
    end = env.step("Drops on the window")
    assert (end.done, end.won, end.reward) == (True, False, 0.0)


def test_the_answer_of_a_completion():
    assert given_answer("<action>go to desk 1</action>") == "go to desk 1"
    assert given_answer("<action>a</action> then <action>b") == "b"  # the last tag; the stop string cut it
    assert given_answer("  just text\n") == "just text"


def test_the_expert_answers_the_line_and_needs_one(spec):
    assert spec.expert("greeting").act(None) == "hi"
    with pytest.raises(ValueError, match="has no \"answer\""):
        spec.expert("train/2")


@pytest.mark.parametrize(("content", "problem"), [
    ("{not json\n", "line 1: not JSON"),
    ('{"answer": "x"}\n', 'non-empty string "prompt"'),
    ('{"prompt": "a", "label": 1}\n', "unknown keys \\['label'\\]"),
    ('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n', "line 2: id 'x' appears twice"),
    ("\n", "no prompts"),
])
def test_bad_files_are_named(tmp_path, content, problem):
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=problem):
        make_env_spec(EnvConfig(name="prompts", options={"files": {"train": str(path)}}))


def test_bad_options_are_named(tmp_path):
    with pytest.raises(ValueError, match="needs option `files`"):
        make_env_spec(EnvConfig(name="prompts"))
    with pytest.raises(ValueError, match="files.train: .* is not a file"):
        make_env_spec(EnvConfig(name="prompts", options={"files": {"train": str(tmp_path / "none.jsonl")}}))
    with pytest.raises(ValueError, match="unknown prompts options"):
        make_env_spec(EnvConfig(name="prompts", options={"path": "x"}))


def test_inline_pool_plays_in_this_process(spec):
    with EnvPool(spec, num_workers=2, workers=InlineWorkers) as pool:
        assert pool.pids == [os.getpid(), os.getpid()]
        starts = pool.reset(["train/0", "train/1", "greeting"])
        assert [s.observation for s in starts] == ["What is 2 + 3?", "Name the capital of France.", "Say hi."]
        ends = pool.step({0: "5", 1: "Rome", 2: "hi"})
        assert [ends[slot].won for slot in range(3)] == [True, False, True]
        assert pool.reset(["no-such-task"])[0].info["env_error"] == "KeyError: 'no-such-task'"  # ends that episode only
        assert pool.reset(["train/1"])[0].observation == "Name the capital of France."


def test_inline_pool_refuses_a_step_latency(spec, tmp_path):
    with pytest.raises(ValueError, match="stall every episode"):
        EnvPool(spec, num_workers=1, step_latency_s=0.5, workers=InlineWorkers)
    from turnopd.config import RecipeError
    from turnopd.orchestration.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: x\nstudent: {{path: m}}\nteachers: {{prompts: t.yaml}}\nenv: {{name: prompts, pool: inline, "
                      f"step_latency_s: 0.5, options: {{files: {{train: {tmp_path}/train.jsonl}}}}}}\n")
    with pytest.raises(RecipeError, match="'env.step_latency_s' with env.pool=inline"):
        load_recipe(recipe)


@pytest.mark.slow
def test_two_distillation_steps_on_prompts_inline_and_in_worker_processes(tmp_path, tiny_model_dir):
    """The same steps whether the prompts play inline or in worker processes."""
    from tests.conftest import TINY_MODEL_SIZE
    from turnopd.models.tiny import build_tiny_model

    build_tiny_model(tmp_path / "student", tokenizer=tiny_model_dir, **TINY_MODEL_SIZE, seed=7)
    (tmp_path / "teacher.yaml").write_text(f"name: tiny-teacher\nmodel: {tiny_model_dir}\nbackend: transformers\n"
                                           "dtype: float32\nmax_length: 1024\n")
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"Your task is to: put pencil {i} on desk."}
                                                  for i in range(6)])
    (tmp_path / "recipe.yaml").write_text(
        f"name: prompts\noutput_dir: {tmp_path}/runs\nstudent: {{path: {tmp_path}/student}}\n"
        f"teachers: {{prompts: {tmp_path}/teacher.yaml}}\ntracking: []\n"
        f"env: {{name: prompts, max_turns: 1, eval_split: train, num_workers: 1, options: {{files: {{train: {data}}}}}}}\n"
        "policy: {max_new_tokens: 6}\ndepth: {mode: full, h_min: 1}\nloss: {mode: token_mean}\n"
        "trainer: {steps: 2, episodes_per_step: 4, lr: 1.0e-3}\neval: {max_tasks: 2, at_start: false}\n")
    env = child_env()
    records = {}
    for pool in ("inline", "local"):
        run = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(tmp_path / "recipe.yaml"),
                              f"name={pool}", f"env.pool={pool}"], env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        records[pool] = [r for r in read_metrics(tmp_path / "runs" / pool / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records["inline"]] == [1, 2]
    for got, want in zip(records["inline"], records["local"], strict=True):
        assert (got["episodes"], got["env_steps"], got["mean_turns"]) == (4, 4, 1.0)
        assert got["tokens_generated"] == want["tokens_generated"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)


def test_env_prompts_writes_the_first_turns_that_env_play_shows(tmp_path, monkeypatch, capsys):
    """`turnopd env prompts` against the prompt `turnopd env play --show-prompt` prints for the same
    task, and the expert's first action as the answer; the file is a prompts env's split."""
    from turnopd.cli import main

    settings = ["task_types=[look_at_obj_in_light]", "template=notebook", "answer_format=action", "history_length=1",
                "options.notes=true"]
    out = tmp_path / "first.jsonl"
    assert main(["env", "prompts", "alfworld", "--split", "valid_seen", "-o", str(out), "--n", "2",
                 "--expert-answers", *settings]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["type"] == "look_at_obj_in_light" for r in rows)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("quit\n"))
    capsys.readouterr()
    assert main(["env", "play", "alfworld", "--split", "valid_seen", "--task", "1", "--show-prompt", *settings]) == 0
    shown = capsys.readouterr().out.split("--- prompt ---\n", 1)[1].split("\n--------------", 1)[0]
    assert rows[1]["prompt"] == shown
    alfworld = make_env_spec(EnvConfig(name="alfworld", task_types=["look_at_obj_in_light"]))
    assert rows[1]["id"] == alfworld.tasks("valid_seen")[1]
    env = alfworld.make()
    assert rows[1]["answer"] == alfworld.expert(rows[1]["id"]).act(env.reset(rows[1]["id"]))
    env.close()
    spec = make_env_spec(EnvConfig(name="prompts", options={"files": {"valid_seen": str(out)}}))
    assert spec.tasks("valid_seen") == [r["id"] for r in rows]


def test_a_derived_split_is_rendered_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNOPD_CACHE", str(tmp_path / "cache"))
    source = {"env": "alfworld", "split": "valid_seen", "max_tasks": 2, "expert_answers": True,
              "settings": {"task_types": ["look_at_obj_in_light"]}}
    spec = make_env_spec(EnvConfig(name="prompts", options={"files": {"valid_seen": source}}))
    path = spec.files["valid_seen"]
    assert path.is_relative_to(tmp_path / "cache" / "prompts") and len(spec.tasks("valid_seen")) == 2
    mtime = path.stat().st_mtime_ns
    again = make_env_spec(EnvConfig(name="prompts", options={"files": {"valid_seen": source}}))
    assert again.files["valid_seen"] == path and path.stat().st_mtime_ns == mtime  # not rendered again
    with pytest.raises(ValueError, match="a derived source needs `env` and `split`"):
        make_env_spec(EnvConfig(name="prompts", options={"files": {"train": {"env": "alfworld"}}}))
