"""Dry-run model rules (turnopd.orchestration.preflight): hub names, vllm_server teachers, bad values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from teachers.spec import TeacherSpec
from turnopd.cli import main
from turnopd.config import ModelConfig, RecipeError
from turnopd.core.data import resolve_data
from turnopd.orchestration.preflight import check_student, check_teacher, is_hub_name


@pytest.mark.parametrize("name", ["Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct",
                                  "HuggingFaceTB/SmolLM2-135M-Instruct", "a/b", "org_1/model.v2"])
def test_hub_names(name):
    assert is_hub_name(name)


@pytest.mark.parametrize("name", ["", "gpt2", "runs/teachers/webshop", "../../runs/teachers/webshop", "./model",
                                  "/abs/model", "~/model/x", "org/", "/name", "org/name/", "a b/c", "org/na me",
                                  "org--x/y", "org/na..me", "-org/name", "org/name-", "org/" + "x" * 100])
def test_not_hub_names(name):
    assert not is_hub_name(name)


def test_student_origins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    assert "local folder" in check_student(ModelConfig(path=str(tmp_path / "model")))
    note = check_student(ModelConfig(path="Qwen/Qwen3-1.7B"))
    assert "Hugging Face hub model Qwen/Qwen3-1.7B" in note and "fetched from the hub at run time" in note
    note = check_student(ModelConfig(path=str(tmp_path / "new"), prepare="tiny"))
    assert "built by model preparation 'tiny'" in note  # an unknown preparation: tests/test_config.py


@pytest.mark.parametrize("path", ["runs/typo/model", "./nope", "/no/such/model", "", "model.bin", "runs/student"])
def test_bad_student_paths_name_the_key(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.bin").write_text("x")
    (tmp_path / "runs").mkdir()  # so runs/student is a missing local folder, not the hub's runs/student
    with pytest.raises(RecipeError, match=r"recipe key 'student\.path'"):
        check_student(ModelConfig(path=path))


def _spec(**kw) -> TeacherSpec:
    base = {"name": "t", "model": "Qwen/Qwen3-8B", "backend": "vllm_server", "url": "http://127.0.0.1:8000",
            "source": "/x/teacher.yaml"}
    return TeacherSpec(**{**base, **kw})


def test_vllm_server_teacher_is_not_contacted(no_network):
    note = check_teacher(_spec(options={"served_model_name": "Qwen/Qwen3-8B"}))
    assert "vllm_server http://127.0.0.1:8000 serving 'Qwen/Qwen3-8B'" in note
    assert "not contacted in a dry run" in note
    assert "tokenizer from Hugging Face hub model Qwen/Qwen3-8B, fetched from the hub at run time" in note


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost", "ftp://h:1", "http://", "http://h:99999", None])
def test_bad_teacher_urls_name_the_key(url):
    with pytest.raises(RecipeError, match=r"teacher spec /x/teacher.yaml: key 'url'"):
        check_teacher(_spec(url=url))


def test_teacher_models(tmp_path):
    assert "hub model Qwen/Qwen3-8B" in check_teacher(_spec(backend="transformers", url=None))
    assert "local folder" in check_teacher(_spec(backend="vllm", model=str(tmp_path)))
    with pytest.raises(RecipeError, match=r"key 'model': '../../runs/teachers/x' is not a local folder \(looked next "
                                          r"to the spec and under the repository\)"):
        check_teacher(_spec(backend="transformers", model="../../runs/teachers/x"))
    with pytest.raises(RecipeError, match=r"key 'tokenizer'"):
        check_teacher(_spec(tokenizer="./no/such/tokenizer"))
    # a missing model that the spec's sft_recipe builds (TeacherSpec.sft_recipe, or any object with it)
    spec = SimpleNamespace(**{**vars(_spec(backend="transformers", model="../../runs/teachers/x")),
                              "sft_recipe": "recipes/x/teacher_sft.yaml"})
    assert "built by `turnopd sft recipes/x/teacher_sft.yaml` at run time" in check_teacher(spec)


RECIPE = """
name: hub
output_dir: {root}/runs
student: {{path: {student}}}
teachers: {{search: {root}/teacher.yaml}}
env: {{name: search, eval_split: test, max_turns: 4, max_tasks: 4}}
eval: {{max_tasks: 2}}
"""

SPEC = "name: t8b\nmodel: {model}\nbackend: vllm_server\nurl: {url}\nmax_length: 4096\n"


def _dry_run(tmp_path, student="Qwen/Qwen3-1.7B", model="Qwen/Qwen3-8B", url="http://10.0.0.5:8000", overrides=(),
             spec_lines=""):
    (tmp_path / "teacher.yaml").write_text(SPEC.format(model=model, url=url) + spec_lines)
    (tmp_path / "recipe.yaml").write_text(RECIPE.format(root=tmp_path, student=student))
    return main(["distill", str(tmp_path / "recipe.yaml"), *overrides, "--dry-run"])


def test_dry_run_of_hub_models_and_a_server_teacher(tmp_path, capsys, no_network):
    assert _dry_run(tmp_path) == 0
    out = capsys.readouterr().out
    assert "recipe OK: env search" in out
    assert "student: Hugging Face hub model Qwen/Qwen3-1.7B, fetched from the hub at run time" in out
    assert "vllm_server http://10.0.0.5:8000" in out and "not contacted in a dry run" in out
    # several held-out splits joined by '+': their tasks one after the other, then eval.max_tasks
    assert _dry_run(tmp_path, overrides=["env.eval_split=test+train", "eval.max_tasks=null"]) == 0
    assert "(4 train / 8 test+train tasks)" in capsys.readouterr().out


def test_dry_run_of_a_keyed_server_teacher_needs_its_key_variable(tmp_path, capsys, monkeypatch, no_network):
    monkeypatch.delenv("TURNOPD_TEST_TEACHER_KEY", raising=False)
    assert _dry_run(tmp_path, spec_lines="api_key_env: TURNOPD_TEST_TEACHER_KEY\n") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: recipe key 'teachers.search': teacher spec ") and (
        "key 'api_key_env': the environment variable TURNOPD_TEST_TEACHER_KEY is not set") in err
    monkeypatch.setenv("TURNOPD_TEST_TEACHER_KEY", "s3cret")
    assert _dry_run(tmp_path, spec_lines="api_key_env: TURNOPD_TEST_TEACHER_KEY\n") == 0
    out = capsys.readouterr().out
    assert "requests carry the API key in $TURNOPD_TEST_TEACHER_KEY" in out and "s3cret" not in out


@pytest.mark.parametrize(("kw", "message"), [
    ({"student": "runs/typo/model"}, "recipe key 'student.path'"),
    ({"url": "10.0.0.5:8000"}, "key 'url'"),
    ({"model": "../../no/such/teacher"}, "key 'model'"),
    ({"overrides": ["env.eval_split=test+tset"]}, "recipe key 'env.eval_split': unknown search split 'tset' in 'test+tset'"),
    ({"overrides": ["eval.split=test+test"]}, "recipe key 'eval.split': split 'test+test' names a split twice"),
    ({"overrides": ["env.train_split=valid"]}, "recipe key 'env.train_split': unknown search split 'valid'"),
])
def test_dry_run_fails_on_bad_values(kw, message, tmp_path, capsys, no_network):
    assert _dry_run(tmp_path, **kw) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def _write_run(run_dir, recipe, steps_done: int) -> None:
    """A run folder of `recipe` (4 steps) with `steps_done` train records; the final evaluation at 4."""
    import json

    from turnopd.config import to_yaml
    from turnopd.orchestration.recipe import load_recipe

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(load_recipe(recipe, ["trainer.steps=4"])))
    records = [{"kind": "start", "total_steps": 4}] + [
        {"kind": "train", "step": s, "train_time_s": float(s)} for s in range(1, steps_done + 1)]
    if steps_done == 4:
        records.append({"kind": "eval", "step": 4, "train_time_s": 4.0, "avg_at_k": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_resume_auto_continues_the_newest_incomplete_run_and_exits_0_on_a_complete_one(tmp_path, capsys,
                                                                                       monkeypatch, no_network):
    runs = tmp_path / "runs"
    assert _dry_run(tmp_path, overrides=["trainer.steps=4", "--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert f"run dir {runs / 'hub'}, data folder " in out and "(resumed)" not in out  # none yet: a new run
    assert f"data folder {resolve_data('multihop')}\n" in out
    _write_run(runs / "hub", tmp_path / "recipe.yaml", 4)  # complete
    _write_run(runs / "hub-2", tmp_path / "recipe.yaml", 2)  # killed after step 2: the newest
    assert _dry_run(tmp_path, overrides=["trainer.steps=4", "--resume", "auto"]) == 0
    assert f"run dir {runs / 'hub-2'} (resumed)" in capsys.readouterr().out
    _write_run(runs / "hub-3", tmp_path / "recipe.yaml", 4)  # the newest is complete: not trained again
    monkeypatch.setenv("TURNOPD_RESUME", "auto")  # the scheduler's way: the same command line
    assert _dry_run(tmp_path, overrides=["trainer.steps=4"]) == 0
    captured = capsys.readouterr()
    assert "recipe OK" not in captured.out
    assert f"--resume auto: the newest run named 'hub', {runs / 'hub-3'}, is complete" in captured.out
    # a different recipe under the run's name (more steps, say) is refused, naming what differs
    assert _dry_run(tmp_path, overrides=["trainer.steps=5"]) == 2
    assert f"error: --resume {runs / 'hub-3'}: the recipe differs from the run's config.yaml in ['trainer']" in (
        capsys.readouterr().err)
    monkeypatch.setenv("TURNOPD_RESUME", str(runs / "hub-2"))
    assert _dry_run(tmp_path, overrides=["trainer.steps=4"]) == 2
    assert "error: TURNOPD_RESUME=" in capsys.readouterr().err


def test_a_resume_on_another_world_size_is_refused_at_start(tmp_path, capsys, monkeypatch, no_network):
    runs = tmp_path / "runs"
    assert _dry_run(tmp_path, overrides=["trainer.steps=4"]) == 0
    _write_run(runs / "hub", tmp_path / "recipe.yaml", 2)
    checkpoint = runs / "hub" / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "loop_state.json").write_text('{"step": 2}')
    for rank in (0, 1):  # written by 2 ranks
        (checkpoint / f"rng_{rank}.pt").write_bytes(b"")
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _dry_run(tmp_path, overrides=["trainer.steps=4", "--resume", "auto"]) == 2
    assert (f"error: --resume {runs / 'hub'}: its checkpoint step_000002 was written by 2 rank(s) and this launch "
            "has 1; resume it on 2") in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _dry_run(tmp_path, overrides=["trainer.steps=4", "--resume", str(runs / "hub")]) == 0
    assert f"run dir {runs / 'hub'} (resumed)" in capsys.readouterr().out
