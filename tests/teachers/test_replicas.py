"""The vllm_server teacher's replicas: least-loaded spreading, failover on each kind of fault, a
replica taken back once it answers, and the clear error when none does.

The replicas here are real HTTP servers on 127.0.0.1 that answer vLLM's /v1/completions format
with the tiny transformers teacher's scores, so that each fault (HTTP 500/503, truncated JSON,
wrong token counts, a hang, a server shut down mid-step) can be injected on demand. The same client
against real vLLM servers, one killed mid-run: tests/teachers/test_vllm_teachers.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from teachers import TeacherServerError, TeacherSpec, TeacherSpecError, make_teacher, merge_replica_stats
from teachers.spec import server_urls
from teachers.vllm_server import Replicas
from tests.teachers.test_teachers import random_ids


class Replica:
    """One server: `mode` says how it answers (ok, http500, http503, http400, truncated, wrong_count,
    hang, die: shut down on the next request, leaving it unanswered). With `key`, a request whose
    Authorization header is not `Bearer <key>` gets vLLM's answer to it, HTTP 401 {"error": "Unauthorized"};
    `authorizations` lists the header of every request."""

    def __init__(self, teacher, key: str | None = None):
        self.mode, self.requests, self.teacher, self.stopped = "ok", 0, teacher, False
        self.key, self.authorizations = key, []
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                replica.requests += 1
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                replica.authorizations.append(self.headers.get("Authorization"))
                mode = "http401" if replica.key and self.headers.get("Authorization") != f"Bearer {replica.key}" \
                    else replica.mode
                if mode == "die":  # the server goes away with this request unanswered
                    replica.stop()
                    return
                if mode == "hang":
                    time.sleep(3.0)
                if mode == "http401":
                    self.send_response(401)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(b'{"error":"Unauthorized"}')
                    return
                if mode.startswith("http"):
                    self.send_response(int(mode[4:]))
                    self.end_headers()
                    self.wfile.write(b"injected")
                    return
                body = json.dumps(replica.answer(payload["prompt"], payload["prompt_logprobs"], mode))
                if mode == "truncated":
                    body = body[: len(body) // 2]
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, prompts: list[list[int]], topk: int, mode: str) -> dict:
        """vLLM's completions answer: per prompt, prompt_logprobs [None, {token: {logprob, rank}}, ...]."""
        choices = []
        for i, (ids, scores) in enumerate(zip(prompts, self.teacher.score(prompts, topk=topk), strict=True)):
            entries = [None]
            for p in range(1, len(ids)):
                top = list(zip(scores.topk_ids[p], scores.topk_logprobs[p], strict=True)) if topk else []
                entry = {str(t): {"logprob": lp, "rank": r} for r, (t, lp) in enumerate(top, start=1)}
                entry.setdefault(str(ids[p]), {"logprob": scores.logprobs[p], "rank": topk + 1})
                entries.append(entry)
            if mode == "wrong_count":
                entries = entries[:-1]
            choices.append({"index": i, "text": "", "prompt_logprobs": entries})
        return {"choices": choices}

    def stop(self):
        if not self.stopped:
            self.stopped = True
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return make_teacher(TeacherSpec(name="ref", model=str(tiny_model_dir), dtype="float32", max_length=1024))


@pytest.fixture
def replicas(reference) -> Iterator[list[Replica]]:
    servers = [Replica(reference), Replica(reference)]
    yield servers
    for server in servers:
        server.stop()


def client_for(tiny_model_dir, urls: list[str], api_key_env: str | None = None, **options):
    return make_teacher(TeacherSpec(name="t", model=str(tiny_model_dir), backend="vllm_server", urls=urls,
                                    max_length=1024, api_key_env=api_key_env,
                                    options={"batch_size": 2, "timeout_s": 10.0, "backoff_s": 0.2, **options}))


SEQUENCES = [random_ids(12 + i, 200, seed=i) for i in range(8)]  # 4 batches of 2


def flat_logprobs(scores) -> list[float]:
    return [lp for s in scores for lp in s.logprobs]


def test_urls_or_url():
    assert server_urls(TeacherSpec(name="a", model="m", url="http://h:1/")) == ["http://h:1"]
    assert server_urls(TeacherSpec(name="a", model="m", urls=["http://h:1", "http://h:2/"])) == ["http://h:1", "http://h:2"]


def test_least_loaded_choice_and_back_off():
    router = Replicas(["a", "b"], backoff_s=0.5, max_backoff_s=1.0)
    first = router.acquire(4)
    second = router.acquire(2)  # a has 4 outstanding: b
    assert (first.url, second.url) == ("a", "b")
    third = router.acquire(1)  # b has 2 < 4
    assert third.url == "b"
    router.failed(first, 4, "HTTP 500")
    # a is down for 0.5 s (its back-off doubles to 1.0 s for the next failure): b even with 3 outstanding
    assert router.acquire(1).url == "b"
    assert router.replicas[0].backoff_s == 1.0
    stats = router.take_stats()
    assert stats["a"] == {"requests": 1, "failures": 1, "up": False, "mean_latency_s": 0.0}
    b = router.replicas[1]
    for _ in range(4):
        router.answered(b, 1, 0.25)
    router.answered(b, 1, 0.5)
    assert router.take_stats()["b"]["mean_latency_s"] == pytest.approx((4 * 0.25 + 0.5) / 5)
    assert router.take_stats()["b"]["requests"] == 0  # counted since the last call


def test_replica_stats_of_two_spans_merge():
    a = {"t": {"u1": {"requests": 3, "failures": 1, "up": True, "mean_latency_s": 0.5},
               "u2": {"requests": 2, "failures": 0, "up": True, "mean_latency_s": 1.0}}}
    b = {"t": {"u1": {"requests": 4, "failures": 0, "up": False, "mean_latency_s": 0.2}},
         "s": {"v": {"requests": 1, "failures": 1, "up": False, "mean_latency_s": 0.0}}}
    merged = merge_replica_stats(a, b)
    # u1: 2 answered at 0.5 s and 4 at 0.2 s -> (1.0 + 0.8) / 6 = 0.3; `up` from the later span
    assert merged["t"]["u1"] == {"requests": 7, "failures": 1, "up": False, "mean_latency_s": pytest.approx(0.3)}
    assert merged["t"]["u2"] == a["t"]["u2"] and merged["s"] == b["s"]
    assert merge_replica_stats({}, a) == a and a["t"]["u1"]["requests"] == 3  # inputs left as they were


def test_two_replicas_share_the_work_and_score_like_the_teacher(tiny_model_dir, replicas, reference):
    client = client_for(tiny_model_dir, [r.url for r in replicas])
    for topk in (0, 3):
        got, want = client.score(SEQUENCES, topk=topk), reference.score(SEQUENCES, topk=topk)
        assert flat_logprobs(got) == pytest.approx(flat_logprobs(want), abs=1e-6)
        if topk:
            assert [s.topk_ids for s in got] == [s.topk_ids for s in want]
    assert all(r.requests >= 1 for r in replicas)  # 8 batches over 2 replicas: both were used
    stats = client.take_replica_stats()
    assert sum(s["requests"] for s in stats.values()) == 8 and not any(s["failures"] for s in stats.values())
    client.close()


@pytest.mark.parametrize("fault", ["http500", "http503", "truncated", "wrong_count", "hang"])
def test_a_faulty_replica_is_marked_down_and_its_batches_go_to_the_other(tiny_model_dir, replicas, reference,
                                                                        fault):
    good, bad = replicas
    bad.mode = fault
    client = client_for(tiny_model_dir, [bad.url, good.url], request_timeout_s=1.0, backoff_s=30.0)
    got = client.score(SEQUENCES)
    assert flat_logprobs(got) == pytest.approx(flat_logprobs(reference.score(SEQUENCES)), abs=1e-6)
    stats = client.take_replica_stats()
    assert stats[bad.url]["failures"] >= 1 and stats[bad.url]["up"] is False
    assert stats[good.url]["failures"] == 0 and stats[good.url]["requests"] >= 4 - stats[bad.url]["requests"]
    # down for its 30 s back-off: the next call does not try it
    before = bad.requests
    client.score(SEQUENCES[:2])
    assert bad.requests == before
    client.close()


def test_a_replica_killed_mid_call_and_one_taken_back(tiny_model_dir, replicas, reference):
    first, second = replicas
    client = client_for(tiny_model_dir, [first.url, second.url])
    first.mode = "die"  # mid-call: its first batch is left unanswered, then its port is closed
    assert flat_logprobs(client.score(SEQUENCES)) == pytest.approx(flat_logprobs(reference.score(SEQUENCES)), abs=1e-6)
    stats = client.take_replica_stats()
    assert stats[first.url]["failures"] >= 1 and stats[second.url]["requests"] >= 4
    # a replica that failed (HTTP 503 while loading) answers again: after its back-off it is used
    second.mode = "http503"
    revived = Replica(reference)
    client3 = client_for(tiny_model_dir, [second.url, revived.url])
    client3.score(SEQUENCES)
    second.mode = "ok"
    time.sleep(0.5)  # past its 0.2 s back-off
    client3.take_replica_stats()
    client3.score(SEQUENCES)
    stats = client3.take_replica_stats()
    assert stats[second.url]["requests"] >= 1 and stats[second.url]["failures"] == 0 and stats[second.url]["up"]
    revived.stop()
    client.close()
    client3.close()


def test_no_replica_answers_a_clear_error_naming_each(tiny_model_dir, replicas):
    for r in replicas:
        r.mode = "http500"
    client = client_for(tiny_model_dir, [r.url for r in replicas], timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(TeacherServerError, match="no answer within 1.5 s") as err:
        client.score(SEQUENCES[:2])
    assert time.monotonic() - t0 < 5.0
    message = str(err.value)
    assert all(f"{r.url}: HTTP 500" in message for r in replicas) and "--resume" in message
    client.close()


def test_a_refused_request_fails_at_once(tiny_model_dir, replicas):
    for r in replicas:
        r.mode = "http400"
    client = client_for(tiny_model_dir, [r.url for r in replicas])
    t0 = time.monotonic()
    with pytest.raises(TeacherServerError, match=r"refused the request \(HTTP 400\)"):
        client.score(SEQUENCES[:2])
    assert time.monotonic() - t0 < 2.0 and sum(r.requests for r in replicas) == 1
    client.close()


KEY_VARIABLE = "TURNOPD_TEST_TEACHER_KEY"


@pytest.fixture
def keyed_replicas(reference) -> Iterator[list[Replica]]:
    servers = [Replica(reference, key="s3cret-A"), Replica(reference, key="s3cret-A")]
    yield servers
    for server in servers:
        server.stop()


def test_the_key_goes_with_every_request_to_every_replica(tiny_model_dir, keyed_replicas, reference, monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, "s3cret-A")
    client = client_for(tiny_model_dir, [r.url for r in keyed_replicas], api_key_env=KEY_VARIABLE)
    got = client.score(SEQUENCES)
    assert flat_logprobs(got) == pytest.approx(flat_logprobs(reference.score(SEQUENCES)), abs=1e-6)
    assert all(r.requests >= 1 for r in keyed_replicas)  # 4 batches over 2 replicas, from 2 threads
    assert {h for r in keyed_replicas for h in r.authorizations} == {"Bearer s3cret-A"}
    client.close()
    unkeyed = Replica(reference)
    plain = client_for(tiny_model_dir, [unkeyed.url])
    plain.score(SEQUENCES[:2])
    assert unkeyed.authorizations == [None]  # a spec without api_key_env sends no header
    unkeyed.stop()
    plain.close()


@pytest.mark.parametrize("sent", ["wrong", "none"])
def test_a_wrong_or_missing_key_fails_at_once_naming_the_url_and_the_variable(tiny_model_dir, keyed_replicas,
                                                                              monkeypatch, sent):
    monkeypatch.setenv(KEY_VARIABLE, "s3cret-B")
    client = client_for(tiny_model_dir, [r.url for r in keyed_replicas],
                        api_key_env=KEY_VARIABLE if sent == "wrong" else None)
    t0 = time.monotonic()
    with pytest.raises(TeacherServerError) as err:
        client.score(SEQUENCES[:2])
    assert time.monotonic() - t0 < 2.0
    assert sum(r.requests for r in keyed_replicas) == 1  # not retried: every replica holds the same key
    (asked,) = (r for r in keyed_replicas if r.requests)
    message = str(err.value)
    assert f"teacher server {asked.url}" in message and 'HTTP 401: {"error":"Unauthorized"}' in message
    if sent == "wrong":
        assert f"refused the API key in ${KEY_VARIABLE}" in message and "s3cret" not in message
    else:
        assert "requires an API key" in message and "api_key_env" in message
    assert client.take_replica_stats()[asked.url]["failures"] == 0  # the replica is not marked down
    client.close()


def test_a_client_whose_key_variable_is_unset_is_refused_before_any_request(tiny_model_dir, keyed_replicas,
                                                                             monkeypatch):
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    with pytest.raises(TeacherSpecError, match=f"key 'api_key_env': the environment variable {KEY_VARIABLE} is "
                                               "not set"):
        client_for(tiny_model_dir, [r.url for r in keyed_replicas], api_key_env=KEY_VARIABLE)
    assert sum(r.requests for r in keyed_replicas) == 0
