"""Teacher replicas on real vLLM servers (run in the vLLM venv: `pytest -m vllm`): two
`turnopd teacher serve` servers of the tiny teacher behind one vllm_server spec. Scores equal one
server's; one replica SIGKILLed in the middle of a call leaves the call complete; a 2-step
distillation with two replicas has the losses of the one-replica run, also when a replica is
killed after its first step. The faults one by one, on injectable servers: test_replicas.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm is not installed in this environment (run in the vLLM venv)")

from teachers import load_teacher_spec, make_teacher, save_teacher_spec  # noqa: E402
from tests.conftest import loop_models  # noqa: E402
from tests.teachers.test_vllm_teachers import TOPK, assert_same_scores, sequences, serve_teacher, spec_for  # noqa: E402
from tests.test_choices import RECIPE  # noqa: E402
from turnopd.core.metrics import read_metrics  # noqa: E402


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir, tmp_path_factory):
    """[(url, server PID)] of two servers; the second may be killed by a test."""
    with serve_teacher(tiny_model_dir, tmp_path_factory) as first, \
            serve_teacher(tiny_model_dir, tmp_path_factory) as second:
        yield [(load_teacher_spec(spec).url, pid) for spec, pid, _ in (first, second)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return make_teacher(spec_for(tiny_model_dir, "transformers"))


def test_two_real_replicas_score_like_one_and_survive_one_killed_mid_call(tiny_model_dir, two_servers, reference):
    (url_a, _), (url_b, pid_b) = two_servers
    options = {"batch_size": 1, "timeout_s": 120.0, "backoff_s": 60.0}
    both = make_teacher(spec_for(tiny_model_dir, "vllm_server", urls=[url_a, url_b], options=options))
    one = make_teacher(spec_for(tiny_model_dir, "vllm_server", url=url_a, options=options))
    seqs = sequences(reference)
    assert_same_scores(both.score(seqs, topk=TOPK), one.score(seqs, topk=TOPK), TOPK)
    stats = both.take_replica_stats()
    assert stats[url_a]["requests"] >= 1 and stats[url_b]["requests"] >= 1  # both were used

    many = seqs * 6  # 36 requests of one sequence
    replica_b = both.replicas.replicas[1]

    def kill_b_once_it_answered() -> None:
        while replica_b.requests < 2:
            time.sleep(0.005)
        os.kill(pid_b, signal.SIGKILL)

    killer = threading.Thread(target=kill_b_once_it_answered)
    killer.start()
    got = both.score(many, topk=TOPK)
    killer.join()
    assert_same_scores(got, reference.score(many, topk=TOPK), TOPK)
    stats = both.take_replica_stats()
    assert stats[url_b]["failures"] >= 1 and not stats[url_b]["up"]
    assert stats[url_a]["failures"] == 0
    both.close()
    one.close()


def test_a_run_with_two_replicas_has_the_losses_of_one_and_survives_a_killed_replica(tiny_model_dir,
                                                                                    tmp_path_factory):
    models = loop_models(tmp_path_factory.mktemp("replicas"), tiny_model_dir, RECIPE)
    with serve_teacher(tiny_model_dir, tmp_path_factory) as (spec_a, _, _), \
            serve_teacher(tiny_model_dir, tmp_path_factory) as (spec_b, pid_b, _):
        urls = [load_teacher_spec(spec_a).url, load_teacher_spec(spec_b).url]

        def run(name: str, replica_urls: list[str], kill_b_after_step: int | None = None) -> list[dict]:
            # one sequence a request, so that a step's scoring goes to both replicas
            spec = save_teacher_spec(spec_for(tiny_model_dir, "vllm_server", urls=replica_urls,
                                              options={"batch_size": 1}), models / f"teacher-{name}.yaml")
            env = {k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
            metrics, log_path = models / "runs" / name / "metrics.jsonl", models / f"{name}.log"
            log = log_path.open("w")
            proc = subprocess.Popen([sys.executable, "-m", "turnopd.cli", "distill", str(models / "recipe.yaml"),
                                     f"name={name}", f"teachers.alfworld={spec}"],
                                    env={**env, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
            if kill_b_after_step is not None:  # once the step's record is written, before the next step scores
                while not (metrics.exists() and any(r["kind"] == "train" and r["step"] == kill_b_after_step
                                                    for r in read_metrics(metrics))):
                    assert proc.poll() is None, log_path.read_text()[-3000:]
                    time.sleep(0.05)
                os.kill(pid_b, signal.SIGKILL)
            returncode = proc.wait(timeout=900)
            log.close()
            assert returncode == 0, log_path.read_text()[-3000:]
            return [r for r in read_metrics(metrics) if r["kind"] == "train"]

        one = run("one-replica", urls[:1])
        two = run("two-replicas-b-killed", urls, kill_b_after_step=1)
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5, abs=1e-7)
    replicas = [r["teacher_replicas"]["tiny-teacher"] for r in two]
    assert replicas[0][urls[1]]["requests"] >= 1 and replicas[0][urls[1]]["failures"] == 0  # step 1: both used
    assert replicas[1][urls[1]]["failures"] >= 1 and not replicas[1][urls[1]]["up"]  # step 2: B is down
    assert replicas[1][urls[0]]["failures"] == 0
