"""Talking to an OpenEnv server, inside an env-pool worker.

OpenEnv 0.3's HTTP /reset and /step make a new env for every request; an episode lives in a session
of its WebSocket endpoint /ws: {"type": "reset" | "step", "data": ...} answered by {"type":
"observation", "data": {"observation": {...}, "reward": r, "done": d}} or {"type": "error"}.
A server that the adapter starts itself (`app`) runs as a child of the worker, on a free port.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class OpenEnvError(RuntimeError):
    """The server is unreachable, died, timed out or refused a message: the episode ends (env_error)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process: SIGTERM when the worker that started it dies (Linux), so that a
    worker the pool kills leaves no server behind."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


class LocalServer:
    """`python -m uvicorn APP` in `app_dir`, (re)started on demand; stopped with its worker."""

    def __init__(self, app: str, app_dir: str, timeout_s: float, port: int | None = None):
        self.app, self.app_dir, self.timeout_s, self.port = app, app_dir, timeout_s, port  # port None: a free one
        self.process: subprocess.Popen | None = None
        self.url = ""

    def ensure_running(self) -> str:
        if self.process is not None and self.process.poll() is None:
            return self.url
        port = self.port or free_port()
        self.url = f"ws://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "uvicorn", self.app, "--port", str(port),
                                         "--app-dir", str(Path(self.app_dir).resolve())],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                last = (self.process.stderr.read() or "").strip().splitlines()[-1:]
                raise OpenEnvError(f"the OpenEnv server {self.app} exited at start: {' '.join(last)}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return self.url
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise OpenEnvError(f"the OpenEnv server {self.app} did not listen within {self.timeout_s:g} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a server still importing may not heed SIGTERM yet
                self.process.kill()
                self.process.wait()


class Session:
    """One WebSocket session: an episode at a time. Connecting is retried `retries` times (a server
    starting or briefly away); a message is not: its episode's state is on the server."""

    def __init__(self, url: str, timeout_s: float, retries: int):
        self.url, self.timeout_s, self.retries = url.rstrip("/"), timeout_s, retries
        self.ws: Any = None

    def connect(self) -> None:
        from websockets.sync.client import connect

        self.close()
        ws_url = self.url.replace("http://", "ws://").replace("https://", "wss://") + "/ws"
        for attempt in range(self.retries + 1):
            try:
                self.ws = connect(ws_url, open_timeout=self.timeout_s, max_size=None)
                return
            except (OSError, TimeoutError) as exc:
                if attempt == self.retries:
                    raise OpenEnvError(f"cannot reach the OpenEnv server at {ws_url} ({self.retries + 1} tries): "
                                       f"{type(exc).__name__}: {exc}") from None
                time.sleep(min(2.0**attempt * 0.5, 5.0))

    def request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """A reset or step message and the server's answer's data."""
        from websockets.exceptions import ConnectionClosed

        try:
            self.ws.send(json.dumps({"type": kind, "data": data}))
            answer = json.loads(self.ws.recv(timeout=self.timeout_s))
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            self.close()
            raise OpenEnvError(f"the OpenEnv server at {self.url} stopped answering during {kind}: "
                               f"{type(exc).__name__}: {exc}") from None
        if answer.get("type") == "error":
            raise OpenEnvError(f"the OpenEnv server refused the {kind}: {answer.get('data', {}).get('message')} "
                               f"{answer.get('data', {}).get('errors', '')}".strip())
        return answer["data"]

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
