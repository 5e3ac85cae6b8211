"""Model builds repeat bit for bit on one machine and install, whatever torch's thread count: the
quickstart's recipe (tokenizer and tiny model from expert episodes, then SFT), at a smaller size,
built under 1 and 2 threads; each build records its fingerprint and what it was built with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env
from turnopd.models import BUILD_INFO, weights_fingerprint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BUILD = """
import sys
import turnopd.orchestration.sft  # noqa: F401  (registers the sft preparation)
from turnopd.models import prepare_model
out, tiny = sys.argv[1], sys.argv[2]
prepare_model("sft", out, recipe="recipes/alfworld/teacher_sft.yaml", overrides=[
    "trainer.steps=20", "demos.episodes=8", "model.prepare_options.corpus_episodes=8", f"model.path={tiny}"])
"""


def _build(root: Path, threads: int) -> Path:
    # MKL's strict reproducibility mode: without it, on an Intel Xeon (AVX-512) MKL's kernels round
    # differently under 1 and 2 threads (docs/teachers.md#reproducible-builds)
    env = child_env(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", MKL_CBWR="AUTO,STRICT")
    out = root / f"threads{threads}"
    done = subprocess.run([sys.executable, "-c", BUILD, str(out), str(root / f"tiny{threads}")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_a_build_under_one_and_two_threads_has_the_same_fingerprint(tmp_path):
    one, two = _build(tmp_path, 1), _build(tmp_path, 2)
    records = [json.loads((folder / BUILD_INFO).read_text()) for folder in (one, two)]
    assert [r["built_with"]["threads"] for r in records] == [1, 2]
    # the record's fingerprint is the folder's, and the two builds' weights are the same bytes
    assert [r["weights"] for r in records] == [weights_fingerprint(one), weights_fingerprint(two)]
    assert records[0]["weights"] == records[1]["weights"] is not None
    assert weights_fingerprint(tmp_path / "tiny1") == weights_fingerprint(tmp_path / "tiny2")  # the initial model too
    built_with = records[0]["built_with"]
    assert built_with["mkl_cbwr"] == "AUTO,STRICT"
    assert built_with["versions"]["torch"] and built_with["cpu"] and built_with["cpu_capability"]
