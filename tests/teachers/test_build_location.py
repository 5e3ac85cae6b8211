"""Where a shipped teacher spec's model is built (teachers.spec.build_root): from a non-editable
install, under the working directory's runs/ (or $TURNOPD_CACHE), never inside the installed package."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import child_env
from turnopd.core.data import REPO_ROOT

# loads the packaged alfworld spec, then builds its teacher with a stand-in for the SFT training
BUILD = """
import json, sys
import turnopd, turnopd.orchestration.sft as sft
from teachers import load_teacher_spec

def fake_prepare(kind, path, **options):
    from pathlib import Path
    Path(path).mkdir(parents=True)
    (Path(path) / "config.json").write_text(json.dumps({"built_by": kind, **options}))

sft.prepare_model = fake_prepare
spec = load_teacher_spec("teachers/alfworld/teacher.yaml")
sft.build_missing_teacher(spec)
print(json.dumps({"package": turnopd.__file__, "model": spec.model, "sft_recipe": spec.sft_recipe}))
"""


@pytest.mark.slow  # builds and installs the project's wheel (~15 s)
def test_a_teacher_build_from_a_non_editable_install_lands_in_the_working_directory(tmp_path):
    site, work = tmp_path / "site", tmp_path / "work"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--target", str(site), str(REPO_ROOT)], capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    assert (site / "teachers" / "alfworld" / "teacher.yaml").is_file() and not (site / "recipes").exists()
    shutil.copytree(REPO_ROOT / "recipes", work / "recipes")  # the recipes a user has beside the install
    run = subprocess.run([sys.executable, "-c", BUILD], cwd=work, env=child_env(PYTHONPATH=str(site)),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["package"].startswith(str(site))  # the installed copy ran, not this checkout
    assert out["model"] == str(work / "runs" / "teachers" / "alfworld")
    assert out["sft_recipe"] == str(work / "recipes" / "alfworld" / "teacher_sft.yaml")
    assert json.loads((work / "runs" / "teachers" / "alfworld" / "config.json").read_text())["built_by"] == "sft"
    assert not (site / "runs").exists() and not list(site.glob("**/config.json"))

    # $TURNOPD_CACHE, when set, is the build root instead (from a working directory without a build)
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    shutil.copytree(REPO_ROOT / "recipes", elsewhere / "recipes")
    run = subprocess.run([sys.executable, "-c", BUILD], cwd=elsewhere, capture_output=True, text=True, timeout=600,
                         env=child_env(PYTHONPATH=str(site), TURNOPD_CACHE=str(cache)))
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["model"] == str(cache / "runs" / "teachers" / "alfworld")
    assert (cache / "runs" / "teachers" / "alfworld" / "config.json").is_file() and not (elsewhere / "runs").exists()
