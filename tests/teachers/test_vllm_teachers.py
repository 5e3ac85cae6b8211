"""The vLLM teacher backends on the real vLLM (run in the vLLM venv:
`pytest -m vllm tests/teachers/test_vllm_teachers.py`): in-process prompt log-probs and the
OpenAI-compatible server (started here by `turnopd teacher serve`, stopped by its PID) against the
transformers teacher in fp32, on trajectories the rollout engine played on real ALFWorld games; and
both with a LoRA adapter on the base (enable_lora) against the transformers teacher's merged adapter;
a server started with an API key (spec api_key_env) refuses requests without it."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm is not installed in this environment (run in the vLLM venv)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from envs import make_env_spec  # noqa: E402
from envs.pool import EnvPool  # noqa: E402
from teachers import (  # noqa: E402
    TeacherServerError,
    TeacherSpec,
    load_teacher_spec,
    make_teacher,
    save_teacher_spec,
    score_trajectories,
)
from turnopd.config import EnvConfig, PolicyConfig  # noqa: E402
from turnopd.rollout import POLICY_BACKENDS, SamplingParams  # noqa: E402
from turnopd.rollout.agent_loop import rollout  # noqa: E402

SERVER_READY_S = 300
TOPK = 5


def spec_for(model_dir: Path, backend: str, **kw) -> TeacherSpec:
    return TeacherSpec(name="tiny-teacher", model=str(model_dir), backend=backend, dtype="float32", max_length=1024,
                       **kw)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return make_teacher(spec_for(tiny_model_dir, "transformers"))


@pytest.fixture(scope="module")
def in_process(tiny_model_dir):
    teacher = make_teacher(spec_for(tiny_model_dir, "vllm"))
    yield teacher
    teacher.close()


@pytest.fixture(scope="module")
def alfworld_trajectories(tiny_model_dir):
    """Two real ALFWorld games cut at 3 of 5 turns, played by the tiny model (transformers backend)."""
    env_config = EnvConfig(name="alfworld", max_turns=5, history_length=0, num_workers=1)
    spec = make_env_spec(env_config)
    policy = POLICY_BACKENDS.get("transformers")(tiny_model_dir, PolicyConfig(), dtype="float32")
    with EnvPool(spec, num_workers=1, step_timeout_s=120) as pool:
        return rollout(spec, pool, policy, spec.tasks("valid_seen")[:2], env_config=env_config,
                       sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=1), turn_limits=[3, 3])


def sequences(teacher, n: int = 6) -> list[list[int]]:
    vocab = len(teacher.tokenizer)
    return [torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(i)).tolist()
            for i, length in enumerate([40, 3, 200, 17, 90, 2][:n])]


def assert_same_scores(got, expected, topk: int) -> None:
    for g, e in zip(got, expected, strict=True):
        assert g.logprobs[0] == 0.0
        assert g.logprobs == pytest.approx(e.logprobs, abs=1e-4)
        if topk:
            assert g.topk_ids[0] == []
            torch.testing.assert_close(torch.tensor(g.topk_logprobs[1:]), torch.tensor(e.topk_logprobs[1:]),
                                       atol=1e-4, rtol=0)
            # ids agree wherever the teacher's log-probs are not (near-)tied
            for ids_g, ids_e, lps in zip(g.topk_ids[1:], e.topk_ids[1:], e.topk_logprobs[1:], strict=True):
                gaps = [a - b for a, b in zip(lps, lps[1:], strict=False)]
                if min(gaps, default=1.0) > 1e-3:
                    assert ids_g == ids_e


def test_in_process_prompt_logprobs_match_transformers(in_process, reference):
    seqs = sequences(reference)
    assert_same_scores(in_process.score(seqs, topk=TOPK), reference.score(seqs, topk=TOPK), TOPK)
    assert_same_scores(in_process.score(seqs), reference.score(seqs), 0)
    assert in_process.max_length == 1023  # vLLM keeps one position for the token it generates
    with pytest.raises(ValueError, match="top-k 21 > max_logprobs 20"):
        in_process.score(seqs, topk=21)


def test_alfworld_trajectories_scored_alike(alfworld_trajectories, in_process, reference):
    trajs = alfworld_trajectories
    assert [t.depth for t in trajs] == [3, 3] and all(t.truncated for t in trajs)
    score_trajectories({"alfworld": reference}, trajs, topk=TOPK)
    expected = [[list(turn.teacher_logprobs) for turn in t.turns] for t in trajs]
    score_trajectories({"alfworld": in_process}, trajs, topk=TOPK)
    for traj, exp in zip(trajs, expected, strict=True):
        for turn, e in zip(traj.turns, exp, strict=True):
            assert len(turn.teacher_logprobs) == len(turn.action_ids) == len(turn.teacher_topk_ids)
            assert turn.teacher_logprobs == pytest.approx(e, abs=1e-4)


def test_familiarity_signals_from_vllm_match_transformers_and_bound_its_entropy(alfworld_trajectories, in_process,
                                                                                 reference):
    """The log-prob signals are the transformers teacher's; vLLM's prompt logprobs carry no entropy, so
    action_entropy comes from its top-k and a tail bucket: at most the exact entropy, and closer with
    a larger k."""
    trajs = alfworld_trajectories
    score_trajectories({"alfworld": reference}, trajs)
    exact = [dict(turn.teacher_signals) for t in trajs for turn in t.turns]
    bounds = {}
    for k in (2, 20):
        score_trajectories({"alfworld": in_process}, trajs, topk=k)
        bounds[k] = [dict(turn.teacher_signals) for t in trajs for turn in t.turns]
    for e, small, large in zip(exact, bounds[2], bounds[20], strict=True):
        for name in ("context_logprob", "action_logprob"):
            assert large[name] == pytest.approx(e[name], abs=1e-4)
        assert small["action_entropy"] <= large["action_entropy"] + 1e-6 <= e["action_entropy"] + 2e-6
    assert sum(e["action_entropy"] - b["action_entropy"] for e, b in zip(exact, bounds[20], strict=True)) < sum(
        e["action_entropy"] - b["action_entropy"] for e, b in zip(exact, bounds[2], strict=True))
    score_trajectories({"alfworld": in_process}, trajs)  # no top-k: no entropy
    assert all("action_entropy" not in turn.teacher_signals for t in trajs for turn in t.turns)


def test_in_process_lora_teacher_matches_transformers(lora_adapter, tiny_model_dir, in_process, reference):
    import typing

    from vllm.config.lora import MaxLoRARanks

    from turnopd.loaders.lora import VLLM_LORA_RANKS

    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS  # the ranks the spec picks from are vLLM's
    adapter_dir, _ = lora_adapter
    merged = make_teacher(spec_for(tiny_model_dir, "transformers", adapter=str(adapter_dir)))
    lora = make_teacher(spec_for(tiny_model_dir, "vllm", adapter=str(adapter_dir)))
    try:
        lora_config = lora.llm.llm_engine.vllm_config.lora_config
        assert (lora_config.max_lora_rank, lora_config.max_loras) == (8, 1)  # the adapter's r = 8
        seqs = sequences(reference)
        got = lora.score(seqs, topk=TOPK)
        assert_same_scores(got, merged.score(seqs, topk=TOPK), TOPK)
        base = in_process.score(seqs)  # the same base without the adapter scores otherwise: the test can fail
        assert max(abs(a - b) for g, e in zip(got, base, strict=True)
                   for a, b in zip(g.logprobs, e.logprobs, strict=True)) > 0.1
    finally:
        lora.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@contextlib.contextmanager
def serve_teacher(model_dir: Path, tmp_path_factory, **spec_keys):
    """`turnopd teacher serve` of the model on 127.0.0.1 (spec_keys: more teacher spec keys, e.g. an
    adapter); yields (its spec's path, the vLLM server's PID, the serve command's process)."""
    port = free_port()
    spec_path = save_teacher_spec(spec_for(model_dir, "vllm_server", url=f"http://127.0.0.1:{port}", **spec_keys),
                                  tmp_path_factory.mktemp("spec") / "teacher.yaml")
    log = open(tmp_path_factory.mktemp("log") / "serve.log", "w+")  # noqa: SIM115
    cli = subprocess.Popen([sys.executable, "-m", "turnopd.cli", "teacher", "serve", str(spec_path),
                            "--port", str(port), "--ready-timeout", str(SERVER_READY_S)],
                           stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           start_new_session=True)  # its own process group: server and engine die with it
    try:
        deadline = time.monotonic() + SERVER_READY_S
        while "is served at" not in Path(log.name).read_text():
            assert cli.poll() is None, f"turnopd teacher serve exited: {Path(log.name).read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the teacher server did not start in time"
            time.sleep(1)
        (server_pid,) = child_pids(cli.pid)
        yield spec_path, server_pid, cli
    finally:
        cli.send_signal(signal.SIGTERM)  # the serve command stops its server on SIGTERM
        cli.wait(timeout=60)
        log.close()
        # A server killed with SIGKILL leaves its vLLM engine-core process behind: end the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(cli.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with serve_teacher(tiny_model_dir, tmp_path_factory) as served:
        yield served


KEY_VARIABLE = "TURNOPD_TEST_TEACHER_KEY"


def test_a_keyed_server_refuses_requests_without_its_key_and_scores_like_a_keyless_one(
        server, tiny_model_dir, tmp_path_factory, reference, monkeypatch):
    """`turnopd teacher serve` of a spec with `api_key_env`: vLLM gets the key from that variable, the
    client sends it; without it (or with another) vLLM answers 401 and the client says which server and
    which variable. Comes before the test that SIGKILLs the module's keyless `server`."""
    key = f"test-{secrets.token_hex(8)}"
    monkeypatch.setenv(KEY_VARIABLE, key)  # `serve_teacher` passes the environment on to `turnopd teacher serve`
    seqs = sequences(reference)
    keyless_spec = load_teacher_spec(server[0])
    keyless_spec.options = {"timeout_s": 60.0}
    keyless = make_teacher(keyless_spec)
    with serve_teacher(tiny_model_dir, tmp_path_factory, api_key_env=KEY_VARIABLE) as (spec_path, server_pid, _):
        spec = load_teacher_spec(spec_path)
        spec.options = {"timeout_s": 60.0}
        # on vLLM's environment (VLLM_API_KEY), not its command line, which every user of the node can list
        assert key not in Path(f"/proc/{server_pid}/cmdline").read_text()
        # the server's own answer to a request without the key; /health stays open (the readiness probe)
        payload = {"model": "tiny-teacher", "prompt": seqs[0], "max_tokens": 1, "prompt_logprobs": 0}
        refused = requests.post(f"{spec.url}/v1/completions", json=payload, timeout=30)
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        assert requests.get(f"{spec.url}/health", timeout=30).status_code == 200

        client = make_teacher(spec)
        got, expected = client.score(seqs, topk=TOPK), keyless.score(seqs, topk=TOPK)
        assert [s.logprobs for s in got] == [s.logprobs for s in expected]  # the same vLLM, fp32: exactly
        assert [s.topk_ids for s in got] == [s.topk_ids for s in expected]

        spec.api_key_env = None
        keyless_client = make_teacher(spec)
        with pytest.raises(TeacherServerError, match=rf"teacher server {spec.url} requires an API key \(HTTP 401: "
                                                     r'{"error":"Unauthorized"}\).*api_key_env'):
            keyless_client.score(seqs[:1])
        spec.api_key_env = KEY_VARIABLE
        monkeypatch.setenv(KEY_VARIABLE, "another-key")
        wrong_key_client = make_teacher(spec)
        t0 = time.monotonic()
        with pytest.raises(TeacherServerError, match=rf"teacher server {spec.url} refused the API key in "
                                                     rf"\${KEY_VARIABLE} \(HTTP 401"):
            wrong_key_client.score(seqs[:1])
        assert time.monotonic() - t0 < 2.0  # at once, not retried until timeout_s
        # vLLM checks the key on its /v1 routes only: its SageMaker route scores without it, the reason
        # docs/teacher-servers.md puts a proxy that forwards /v1 in front of a server others can reach
        assert requests.post(f"{spec.url}/invocations", json=payload, timeout=30).status_code == 200
        for teacher in (client, keyless_client, wrong_key_client):
            teacher.close()
    keyless.close()


def test_server_scores_like_transformers_then_fails_clearly_when_killed(server, reference, alfworld_trajectories):
    spec_path, server_pid, cli = server
    spec = load_teacher_spec(spec_path)
    spec.options = {"batch_size": 4, "timeout_s": 120.0, "max_logprobs": 50}
    client = make_teacher(spec)
    spec.options = {"timeout_s": 3.0, "backoff_s": 0.2}
    impatient = make_teacher(spec)
    seqs = sequences(reference)
    assert_same_scores(client.score(seqs, topk=TOPK), reference.score(seqs, topk=TOPK), TOPK)  # 2 requests
    def action_scores() -> list[float]:
        return [x for t in alfworld_trajectories for turn in t.turns for x in turn.teacher_logprobs]

    score_trajectories({"alfworld": client}, alfworld_trajectories)
    by_server = action_scores()
    score_trajectories({"alfworld": reference}, alfworld_trajectories)
    assert by_server == pytest.approx(action_scores(), abs=1e-4)
    # a request the server refuses (its --max-logprobs is 20) fails at once, with the server's reason
    t0 = time.monotonic()
    with pytest.raises(TeacherServerError, match=r"refused the request \(HTTP 400\)"):
        client.score(seqs[:1], topk=30)
    assert time.monotonic() - t0 < 2.0
    # the server dies mid-run: retries with backoff, then a clear error after timeout_s
    os.kill(server_pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TeacherServerError, match=r"no answer within 3 s \((\d+) attempts\)") as err:
        impatient.score(seqs)
    assert 2.0 <= time.monotonic() - t0 <= 8.0
    assert int(str(err.value).split("(")[1].split()[0]) >= 3
    assert "turnopd teacher serve" in str(err.value)
    assert cli.wait(timeout=30) != 0  # `turnopd teacher serve` ends with its server


def test_server_with_a_lora_adapter_scores_like_transformers(lora_adapter, tiny_model_dir, tmp_path_factory,
                                                             reference):
    """`turnopd teacher serve` of a spec with `adapter`: the base served with the adapter as a LoRA module
    (--enable-lora --lora-modules tiny-teacher-lora=ADAPTER); requests that name the module score with
    the adapter, requests that name the base (a spec without it) score as the base."""
    adapter_dir, _ = lora_adapter
    merged = make_teacher(spec_for(tiny_model_dir, "transformers", adapter=str(adapter_dir)))
    seqs = sequences(reference)
    with serve_teacher(tiny_model_dir, tmp_path_factory, adapter=str(adapter_dir)) as (spec_path, _, _):
        spec = load_teacher_spec(spec_path)
        spec.options = {"timeout_s": 60.0}
        client = make_teacher(spec)
        assert client.model_name == "tiny-teacher-lora"
        assert_same_scores(client.score(seqs, topk=TOPK), merged.score(seqs, topk=TOPK), TOPK)
        spec.adapter = None  # the same server's base model
        base_client = make_teacher(spec)
        assert base_client.model_name == "tiny-teacher"
        assert_same_scores(base_client.score(seqs, topk=TOPK), reference.score(seqs, topk=TOPK), TOPK)
        client.close()
        base_client.close()
