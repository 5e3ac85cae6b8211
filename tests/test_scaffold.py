"""`turnopd new env|teacher` run into a temporary copy of the repository layout.

The scaffold's output imports and registers; its generated test fails, one failure per piece left to
fill in, and passes once a (toy) env fills the pieces in.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from teachers.spec import load_teacher_spec
from turnopd.cli import main
from turnopd.orchestration.scaffold import ScaffoldError, add_builtin_env, class_prefix, new_env, new_teacher

REPO = Path(__file__).resolve().parents[1]
ENV_FILES = ["envs/toy/__init__.py", "envs/toy/env.py", "envs/toy/expert.py", "envs/toy/prompt.py",
             "envs/toy/spec.py", "tests/envs/test_toy.py"]
GENERATED_TESTS = ["test_registered", "test_splits_are_non_empty_and_deterministic",
                   "test_the_expert_wins_the_first_task_of_each_split", "test_parse_action_hand_cases",
                   "test_the_prompt_states_the_task", "test_bad_actions_are_invalid_not_errors"]

# A guess-the-number env that fills in the pieces, as a user would.
TOY_ENV = '''
from envs.base import StepOutcome

ACTIONS = [f"say {n}" for n in range(10)]


class ToyEnv:
    def reset(self, task_id: str) -> StepOutcome:
        self.target = int(task_id.split("/")[1])
        return StepOutcome(observation="Think of a digit.", admissible=list(ACTIONS),
                           info={"task": "say the hidden digit"})

    def step(self, action: str) -> StepOutcome:
        won = action == f"say {self.target}"
        return StepOutcome(observation="Right!" if won else "No.", reward=float(won), done=won, won=won,
                           admissible=list(ACTIONS), info={"invalid": action not in ACTIONS})

    def close(self) -> None:
        pass
'''
TOY_EXPERT = '''
from envs.base import StepOutcome


class ToyExpert:
    def __init__(self, task_id: str):
        self.task_id = task_id

    def act(self, outcome: StepOutcome) -> str:
        return "say " + self.task_id.split("/")[1]
'''
TOY_SPEC_TASKS = '''        return select_tasks([f"guess/{n}" for n in TASKS[split]], self.task_type, self.config)'''
TOY_PARSE_CASES = '''PARSE_CASES: list[tuple[str, str, bool]] = [
    ("<think>7?</think><action>say 7</action>", "say 7", True),
    ("say 7", "say 7", False),
]
'''


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """What the scaffold writes into and what its generated test runs with: envs/ (whose BUILTIN_ENVS
    it edits), the test package markers and pytest's settings."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "envs", root / "envs", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "tests" / "envs").mkdir(parents=True)
    for name in ("tests/__init__.py", "tests/envs/__init__.py", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    return root


def run_python(root: Path, *args: str) -> subprocess.CompletedProcess:
    """Python with the copy's `envs` first on the path (turnopd still comes from this checkout)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def run_generated_test(root: Path) -> tuple[int, dict[str, str]]:
    """Exit code of pytest on the generated test, and each test's failure message ("" when passed)."""
    report = root / "report.xml"
    done = run_python(root, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/envs/test_toy.py",
                      f"--junitxml={report}")
    results = {}
    for case in ET.parse(report).iter("testcase"):
        failure = case.find("failure")
        results[case.get("name")] = "" if failure is None else failure.get("message", "")
    return done.returncode, results


def replace_stub(source: str, method: str, code: str) -> str:
    """The generated spec with the `raise NotImplementedError(...)` of ToySpec.<method> replaced."""
    start = source.rindex("        raise NotImplementedError(", 0, source.index(f"ToySpec.{method}("))
    end = source.index("\n        )\n", start) + len("\n        )\n")
    return source[:start] + code + "\n" + source[end:]


def builtin_envs(root: Path) -> tuple[str, ...]:
    for node in ast.parse((root / "envs" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "BUILTIN_ENVS":
            return ast.literal_eval(node.value)
    raise AssertionError("no BUILTIN_ENVS in envs/__init__.py")


def test_new_env_imports_registers_and_its_test_fails_until_filled_in(layout: Path) -> None:
    before = builtin_envs(layout)
    result = new_env("toy", layout)
    assert result.created == ENV_FILES + ["recipes/toy/teacher_sft.yaml"]
    assert result.kept == [] and result.registered
    assert builtin_envs(layout) == (*before, "envs.toy")
    for path in result.created:
        assert "{{" not in (layout / path).read_text(), path
    if shutil.which("ruff"):  # the generated code passes the project's lint
        lint = subprocess.run(["ruff", "check", "--config", str(layout / "pyproject.toml"), "envs/toy",
                               "tests/envs/test_toy.py"], cwd=layout, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout

    probe = run_python(layout, "-c", "from envs import ENVS, make_env_spec; from turnopd.config import EnvConfig; "
                                     "print('toy' in ENVS.names(), type(make_env_spec(EnvConfig(name='toy'))).__name__)")
    assert probe.stdout.split() == ["True", "ToySpec"], probe.stderr
    recipe = run_python(layout, "-c", "from turnopd.orchestration.sft import load_sft_recipe; "
                                      "c = load_sft_recipe('recipes/toy/teacher_sft.yaml'); print(c.env.name, c.output_dir)")
    assert recipe.stdout.split() == ["toy", "runs/teachers/toy"], recipe.stderr

    code, results = run_generated_test(layout)
    assert code == 1 and list(results) == GENERATED_TESTS
    assert results.pop("test_registered") == ""
    assert "PARSE_CASES" in results.pop("test_parse_action_hand_cases")
    # every other failure is a NotImplementedError that names the file to fill in
    for name, message in results.items():
        assert message.startswith("NotImplementedError: envs/toy/"), (name, message)


def test_the_generated_test_passes_once_the_pieces_are_filled_in(layout: Path) -> None:
    new_env("toy", layout)
    (layout / "envs/toy/env.py").write_text(TOY_ENV)
    (layout / "envs/toy/expert.py").write_text(TOY_EXPERT)
    spec = (layout / "envs/toy/spec.py").read_text()
    spec = spec.replace('SPLITS: tuple[str, ...] = ()', 'SPLITS = ("train", "test")\nTASKS = {"train": [3, 7], "test": [5]}')
    spec = spec.replace('TASK_TYPES: tuple[str, ...] = ()', 'TASK_TYPES = ("guess",)')
    spec = spec.replace("    check_split,\n", "    check_split,\n    extract_action,\n    select_tasks,\n")
    spec = replace_stub(spec, "tasks", TOY_SPEC_TASKS)
    spec = replace_stub(spec, "task_type", '        return task_id.split("/")[0]')
    spec = replace_stub(spec, "parse_action", "        return extract_action(text)")
    (layout / "envs/toy/spec.py").write_text(spec)
    test = (layout / "tests/envs/test_toy.py").read_text()
    (layout / "tests/envs/test_toy.py").write_text(test.replace("PARSE_CASES: list[tuple[str, str, bool]] = []\n",
                                                                TOY_PARSE_CASES))
    code, results = run_generated_test(layout)
    assert results == dict.fromkeys(GENERATED_TESTS, "") and code == 0


def test_new_teacher_writes_a_spec_that_loads(layout: Path) -> None:
    new_env("toy", layout)
    result = new_teacher("toy", layout)
    assert result.created == ["teachers/toy/teacher.yaml"]
    assert result.kept == ["recipes/toy/teacher_sft.yaml"]
    spec = load_teacher_spec(layout / "teachers/toy/teacher.yaml")
    assert (spec.name, spec.model, spec.backend, spec.max_length) == ("toy-teacher", "runs/teachers/toy",
                                                                       "transformers", 2048)
    with pytest.raises(ScaffoldError, match="refusing to overwrite teachers/toy/teacher.yaml"):
        new_teacher("toy", layout)
    # an env without a recipe gets one with its teacher
    assert new_teacher("alfworld", layout).created == ["teachers/alfworld/teacher.yaml",
                                                       "recipes/alfworld/teacher_sft.yaml"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("9lives", "env name '9lives': use a lower-case Python identifier"),
        ("My-Env", "env name 'My-Env': use a lower-case Python identifier"),
        ("Toy", "env name 'Toy': use a lower-case Python identifier"),
        ("class", "env name 'class': use a lower-case Python identifier"),
        ("", "env name '': use a lower-case Python identifier"),
        ("alfworld", "env 'alfworld' exists already"),
        ("base", "env name 'base' is taken by envs/base.py"),
    ],
)
def test_bad_env_names_are_refused(layout: Path, name: str, message: str) -> None:
    with pytest.raises(ScaffoldError, match=message):
        new_env(name, layout)


def test_nothing_is_overwritten_or_half_written(layout: Path) -> None:
    init = (layout / "envs/__init__.py").read_text()
    (layout / "tests/envs/test_toy.py").write_text("# mine\n")
    with pytest.raises(ScaffoldError, match="refusing to overwrite tests/envs/test_toy.py \\(nothing written\\)"):
        new_env("toy", layout)
    assert not (layout / "envs/toy").exists() and not (layout / "recipes").exists()
    assert (layout / "envs/__init__.py").read_text() == init
    assert (layout / "tests/envs/test_toy.py").read_text() == "# mine\n"
    with pytest.raises(ScaffoldError, match="no env 'toy' to make a teacher for; envs: alfworld, autoresearch, gymnasium, openenv, prompts"):
        new_teacher("toy", layout)


def test_builtin_envs_edit(tmp_path: Path) -> None:
    init = tmp_path / "__init__.py"
    init.write_text('import x\nBUILTIN_ENVS = ("envs.a", "envs.b")  # why\nfor m in BUILTIN_ENVS:\n    pass\n')
    assert add_builtin_env(init, "envs.c")
    assert init.read_text() == ('import x\nBUILTIN_ENVS = ("envs.a", "envs.b", "envs.c")  # why\n'
                                'for m in BUILTIN_ENVS:\n    pass\n')
    assert add_builtin_env(init, "envs.c") and init.read_text().count("envs.c") == 1  # already there
    long = f'"envs.{"a" * 90}"'
    init.write_text(f"BUILTIN_ENVS = ({long},)  # why\n")  # one line more would pass the line length
    assert add_builtin_env(init, "envs.c")
    assert init.read_text() == f'BUILTIN_ENVS = (\n    {long},\n    "envs.c",\n)  # why\n'
    assert add_builtin_env(init, "envs.d")  # a tuple over several lines is rewritten too
    assert init.read_text() == f'BUILTIN_ENVS = (\n    {long},\n    "envs.c",\n    "envs.d",\n)  # why\n'
    for source in ["BUILTIN_ENVS = tuple(find())\n", "BUILTIN_ENVS = [x for x in y]\n"]:  # not a tuple of strings
        init.write_text(source)
        assert not add_builtin_env(init, "envs.c") and init.read_text() == source


def test_cli(layout: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["new", "env", "toy", "--root", str(layout)]) == 0
    out = capsys.readouterr().out
    assert all(f"created  {path}" in out for path in ENV_FILES)
    assert 'updated  envs/__init__.py (BUILTIN_ENVS imports "envs.toy")' in out
    assert "pytest tests/envs/test_toy.py" in out
    assert main(["new", "env", "toy", "--root", str(layout)]) == 2
    assert "error: env 'toy' exists already" in capsys.readouterr().err
    (layout / "envs/__init__.py").write_text("BUILTIN_ENVS = tuple(found())\n")
    assert main(["new", "env", "other", "--root", str(layout)]) == 0
    assert 'to do    add "envs.other" to BUILTIN_ENVS in envs/__init__.py' in capsys.readouterr().out


def test_class_prefix() -> None:
    assert [class_prefix(n) for n in ("twx", "science_world", "env2")] == ["Twx", "ScienceWorld", "Env2"]
