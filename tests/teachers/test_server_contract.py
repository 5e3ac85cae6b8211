"""The vllm_server teacher's contract checked at start (teachers.vllm_server.check_server): a server
that scores a token-id prompt with prompt log-probs passes; another OpenAI-compatible server (one that
ignores vLLM's `prompt_logprobs`, or refuses it) is refused with the reason; one not up yet is left to
the scoring's retries."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from teachers import TeacherServerError, TeacherSpec
from teachers.vllm_server import check_server

VLLM = (200, {"choices": [{"index": 0, "text": "a", "prompt_logprobs": [None, {"0": {"logprob": -2.5, "rank": 3}}]}]})
PLAIN_OPENAI = (200, {"choices": [{"index": 0, "text": "a", "logprobs": None}]})  # the extension ignored
REFUSING = (400, {"error": "prompt must be a string"})  # token-id prompts or the extension refused


def _server(answer: tuple[int, dict]) -> tuple[ThreadingHTTPServer, list[dict]]:
    status, body = answer
    asked: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            asked.append({"path": self.path, **json.loads(self.rfile.read(int(self.headers["Content-Length"])))})
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, asked


def _spec(*urls: str) -> TeacherSpec:
    return TeacherSpec(name="t", model="Qwen/Qwen3-8B", backend="vllm_server", urls=list(urls))


def test_a_vllm_server_passes_and_other_servers_are_refused_with_the_reason():
    vllm, asked = _server(VLLM)
    with socket.socket() as sock:  # a port where nothing listens: a server not started yet
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    url = f"http://127.0.0.1:{vllm.server_port}"
    check_server(_spec(url, down), timeout_s=2.0)
    assert asked == [{"path": "/v1/completions", "model": "t", "prompt": [[0, 0]], "max_tokens": 1,
                      "temperature": 0.0, "prompt_logprobs": 0}]
    for answer, status in ((PLAIN_OPENAI, 200), (REFUSING, 400)):
        other, _ = _server(answer)
        other_url = f"http://127.0.0.1:{other.server_port}"
        with pytest.raises(TeacherServerError) as err:
            check_server(_spec(url, other_url), timeout_s=2.0)
        assert str(err.value).startswith(f"teacher server {other_url} does not score prompts as vLLM does: a 2-token "
                                         f"prompt with prompt_logprobs 0 got HTTP {status} ")
        assert "the vllm_server teacher needs vLLM's OpenAI-compatible server" in str(err.value)
        other.shutdown()
    vllm.shutdown()
