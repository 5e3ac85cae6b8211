"""Envs as installable plugins: the package that `turnopd new env guess --package DIR` writes, pip-
installed into a folder on PYTHONPATH (not the checkout), is found through its `turnopd.envs` entry point
by `turnopd env list`, `turnopd env expert` and `turnopd distill`, with no file of the checkout changed."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import envs
from envs import ENTRY_POINT_GROUP, ENVS
from tests.conftest import LOOP_RECIPE, child_env, loop_models
from turnopd.cli import main
from turnopd.core.metrics import read_metrics
from turnopd.orchestration.scaffold import new_env_package

REPO = Path(__file__).resolve().parents[2]

# The loop tests' recipe (tests/conftest.py) on the plugin env: 2 steps of 2 episodes
RECIPE = LOOP_RECIPE.replace("alfworld", "guess").replace("valid_seen", "test") + """
name: guess_plugin
depth: {{warmup_steps: 1, probe_every: 1, min_successes: 1}}
trainer: {{steps: 2, episodes_per_step: 2, lr: 1.0e-3}}
eval: {{max_tasks: 1, at_start: false}}
"""


def checkout_state() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scaffolded plugin package, pip-installed (a built wheel, not editable) into a target folder."""
    root = tmp_path_factory.mktemp("plugin")
    new_env_package("guess", root / "turnopd-guess")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--root-user-action=ignore", "--no-deps", "--no-build-isolation",
                    "--target", str(root / "site"), str(root / "turnopd-guess")], check=True, timeout=300)
    return root / "site"


def turnopd(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = child_env(PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "turnopd.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


def test_an_installed_plugin_is_listed_and_its_expert_plays(site: Path) -> None:
    before = checkout_state()
    listed = turnopd(site, "env", "list")
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    rows = [line.split("│")[1:6] for line in listed.stdout.splitlines() if line.startswith("│ guess ")]
    # 40 train tasks, 10 test tasks (digits 0-9): both task types in each
    assert [[cell.strip() for cell in row] for row in rows] == [["guess", "train", "40", "2", "5"],
                                                                ["guess", "test", "10", "2", "5"]]
    played = turnopd(site, "env", "expert", "guess", "--split", "test", "task_types=[high]")
    assert played.returncode == 0, played.stderr
    # binary search over 0..9 finds 5..9 within 4 guesses: all 5 high tasks won
    assert "5/5 episodes played" in played.stdout
    assert any(line.split()[:3] == ["│", "all", "│"] and "100.0%" in line for line in played.stdout.splitlines())
    refused = turnopd(site, "show", str(REPO / "recipes/quickstart.yaml"), "env.name=guess", "teachers.guess=x.yaml",
                      "env.task_types=[odd]")
    assert refused.returncode == 2
    assert refused.stderr.strip() == "error: recipe key 'env.task_types': unknown guess task types ['odd']; allowed: low, high"
    assert checkout_state() == before


@pytest.mark.slow
def test_two_distillation_steps_on_a_plugin_env(site: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    before = checkout_state()
    root = loop_models(tmp_path, tiny_model_dir, "")
    (root / "guess.yaml").write_text(RECIPE.format(root=root))
    run = turnopd(site, "distill", str(root / "guess.yaml"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    train = [r for r in read_metrics(root / "runs" / "guess_plugin" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["tokens_trained"] > 0 for r in train)
    assert checkout_state() == before


def test_the_package_scaffold_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["new", "env", "guess", "--package", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "created  pyproject.toml\ncreated  turnopd_guess/__init__.py\n" in out
    assert f"pip install -e {tmp_path}" in out
    assert 'guess = "turnopd_guess:GuessSpec"' in (tmp_path / "pyproject.toml").read_text()
    assert main(["new", "env", "guess", "--package", str(tmp_path)]) == 2
    assert "error: refusing to overwrite pyproject.toml, turnopd_guess/__init__.py" in capsys.readouterr().err
    assert main(["new", "env", "alfworld", "--package", str(tmp_path / "other")]) == 2
    assert "error: env 'alfworld' exists already" in capsys.readouterr().err


def test_the_builtin_envs_are_declared_as_entry_points() -> None:
    """pyproject.toml's `turnopd.envs` entries name exactly the built-in envs, each its registered class."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
    builtin = {name for name in ENVS.names() if ENVS.get(name).__module__.startswith("envs.")}
    assert set(declared) == builtin
    for name, value in declared.items():
        assert EntryPoint(name, value, ENTRY_POINT_GROUP).load() is ENVS.get(name)


def test_a_plugin_that_fails_to_load_breaks_only_its_own_env(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = [EntryPoint("nothere", "turnopd_nothere:Spec", ENTRY_POINT_GROUP),
              EntryPoint("misnamed", "envs.alfworld:AlfworldSpec", ENTRY_POINT_GROUP)]
    monkeypatch.setattr(envs, "entry_points", lambda group: broken if group == ENTRY_POINT_GROUP else [])
    errors = envs.load_plugins()
    assert errors == {
        "nothere": "env plugin 'nothere' (turnopd_nothere:Spec) failed to load: ModuleNotFoundError: "
                   "No module named 'turnopd_nothere'",
        "misnamed": "env plugin 'misnamed' (envs.alfworld:AlfworldSpec) failed to load: ValueError: "
                    "its class's `name` is 'alfworld', not 'misnamed'"}
    assert "nothere" not in ENVS and "misnamed" not in ENVS
    monkeypatch.setattr(envs, "PLUGIN_ERRORS", errors)
    with pytest.raises(ValueError, match="^env plugin 'nothere' .* No module named 'turnopd_nothere'$"):
        envs.make_env_spec(type("EnvBlock", (), {"name": "nothere"})())


def test_the_docs_show_the_package_the_scaffold_writes(tmp_path: Path) -> None:
    """docs/adding-an-env.md's plugin module is the scaffold's (its docstring aside)."""
    new_env_package("guess", tmp_path)
    written = (tmp_path / "turnopd_guess" / "__init__.py").read_text()
    docs = (REPO / "docs" / "adding-an-env.md").read_text()
    shown = docs.split("`turnopd-guess/turnopd_guess/__init__.py`:\n\n```python\n", 1)[1].split("```", 1)[0]
    assert shown.split("\nimport re\n", 1)[1] == written.split("\nimport re\n", 1)[1]
