"""Re-run every published benchmark, one after another, then regenerate docs/benchmarks.md's table.

    python benchmarks/run_all.py                  # all of them (hours on 2 cores), into benchmarks/results/
    python benchmarks/run_all.py --quick          # a smoke run at the smallest sizes, into a scratch folder
    python benchmarks/run_all.py --only rollout_backends alfworld_engine

Each benchmark runs in the venv it needs (the main one, the vLLM one, the TRL one: see docs/benchmarks.md);
one whose venv or model is missing is skipped with the reason, and the summary says so. The machine
should be quiet: every figure is a ratio or a rate measured against the clock.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENVS = {"main": Path(sys.executable), "vllm": REPO / ".venv-vllm" / "bin" / "python",
         "trl": REPO / ".venv-trl" / "bin" / "python"}


@dataclass(frozen=True)
class Benchmark:
    name: str  # what it writes: benchmarks/results/<name>.json (and more, for a script of several sections)
    venv: str
    args: list[str]
    quick: list[str]  # appended in --quick mode: the smallest sizes that still run every code path
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # paths (~ expanded) that must exist, else skipped with the reason

    def command(self, python: Path, quick: bool) -> list[str]:
        return [str(python), *self.args, *(self.quick if quick else [])]


STUDENT = "~/.cache/turnopd/models/alfworld-student-sft400"
BENCHMARKS = [
    Benchmark("alfworld_engine", "main", ["benchmarks/alfworld_engine.py"], ["--games", "2", "--turns", "5"]),
    Benchmark("env_throughput", "main", ["benchmarks/env_throughput.py", "--envs", "alfworld", "--ray"],
              ["--episodes", "2", "--max-turns", "3"]),
    Benchmark("rollout_engines_transformers", "main", ["benchmarks/rollout_throughput.py", "--engines-only",
                                                       "--backends", "transformers"], ["--episodes", "8"]),
    Benchmark("rollout_engines_vllm", "vllm", ["benchmarks/rollout_throughput.py", "--engines-only", "--backends",
                                               "vllm"], ["--episodes", "8"]),
    # rollout_backends_omp1.json and teacher_scoring.json, under the published command's one thread; then the
    # rollouts again with transformers on both cores (vLLM's CPU worker binds its own threads either way)
    Benchmark("rollout_backends_omp1", "vllm", ["benchmarks/rollout_throughput.py", "--skip-engines"],
              ["--model", "tiny", "--batch-sizes", "1", "4", "--teacher-turns", "2"], {"OMP_NUM_THREADS": "1"}),
    Benchmark("rollout_backends_omp2", "vllm", ["benchmarks/rollout_throughput.py", "--skip-engines",
                                                "--skip-teachers"], ["--model", "tiny", "--batch-sizes", "1", "4"],
              {"OMP_NUM_THREADS": "2"}),
    Benchmark("trainer_throughput_bfloat16", "trl", ["benchmarks/trainer_throughput.py", "--dtype", "bfloat16",
                                                     "--steps", "5"], ["--model", "random", "--steps", "1"]),
    Benchmark("lora_sync", "vllm", ["benchmarks/lora_sync.py"], ["--batch", "1", "--prompt-len", "16",
                                                                 "--action-len", "8"]),
    Benchmark("familiarity_overhead", "main", ["benchmarks/familiarity_overhead.py"],
              ["--trajectories", "2", "--turns", "2"], needs=("runs/teachers/alfworld", STUDENT)),
    Benchmark("cross_tokenizer_cost", "main", ["benchmarks/cross_tokenizer_cost.py"], ["--steps", "1"],
              needs=("runs/teachers/alfworld-smollm2", STUDENT)),  # the recipe's teacher: teachers/alfworld/smollm2.yaml
    Benchmark("generation_batching", "main", ["benchmarks/generation_batching.py"], ["--prompts", "4"],
              needs=("runs/teachers/webshop",)),
    Benchmark("pipeline_overlap", "main", ["benchmarks/pipeline_overlap.py"],
              ["--steps", "3", "--seeds", "0", "--hidden", "64", "--layers", "1"]),
    Benchmark("pipeline_overlap_screenshots", "main", ["benchmarks/pipeline_overlap.py", "--env", "webshop_screenshot"],
              ["--steps", "3", "--seeds", "0"], {"OMP_NUM_THREADS": "2"}),
    Benchmark("trl_end_to_end", "main", ["benchmarks/trl_end_to_end.py"],
              ["--models", "tiny", "--steps", "2", "--warmup", "1", "--repeats", "1"], needs=(".venv-trl",)),
    Benchmark("trl_end_to_end_vllm_rollouts", "main", [
        "benchmarks/trl_end_to_end.py", "--models", "smollm2", "--sides", "turnopd,turnopd-unshared,trl",
        "--policy-backend", "vllm", "--turnopd", ".venv-vllm/bin/turnopd", "--tag", "vllm-rollouts-shared-prefix"],
        ["--steps", "2", "--warmup", "1", "--repeats", "1"], needs=(".venv-trl", ".venv-vllm")),
    Benchmark("chat_context", "main", ["benchmarks/chat_context.py"], ["--repeats", "1", "--episodes", "1"]),
    Benchmark("mixture_play", "main", ["benchmarks/mixture_play.py", "--repeats", "5"], ["--repeats", "1"],
              {"OMP_NUM_THREADS": "1"}),
    Benchmark("screenshot_pipeline", "main", ["benchmarks/screenshot_pipeline.py"],
              ["--episodes", "2", "--turns", "2", "--repeats", "1"],  # the screenshot recipe's builds
              needs=("runs/teachers/webshop/screenshot-teacher", "~/.cache/turnopd/models/webshop-screenshot-student-sft100")),
    Benchmark("screenshot_reading", "main", ["benchmarks/screenshot_reading.py", "--steps", "100", "--pages", "16"],
              ["--steps", "2", "--pages", "2"], {"OMP_NUM_THREADS": "2"}),
    Benchmark("screenshot_reading_layouts", "main", [
        "benchmarks/screenshot_reading.py", "--layouts", "grid", "row_tiles", "--steps", "300", "--pages", "16",
        "--seeds", "0"], ["--steps", "2", "--pages", "2"], {"OMP_NUM_THREADS": "2"}),
    Benchmark("screenshot_reading_scale", "main", [
        "benchmarks/screenshot_reading.py", "--layouts", "row_tiles", "--steps", "2000", "--train-episodes", "400",
        "--pages", "16", "--seeds", "0", "--tag", "scale"], ["--steps", "2", "--pages", "2", "--train-episodes", "2"],
        {"OMP_NUM_THREADS": "2"}),
    Benchmark("screen_reader", "main", ["benchmarks/screen_reader.py"],
              ["--steps", "2", "--episodes", "2", "--eval-episodes", "2"], {"OMP_NUM_THREADS": "2"}),
]
# result files no entry above writes under its own name (the experiments' folders are not here either:
# their pages give their commands)
WRITTEN_ELSEWHERE = {
    "teacher_scoring": "rollout_backends_omp1 writes it",
    "screenshot_heldout_kl": "it reads a sweep's runs: docs/results/2026-12-05-screenshots.md gives the commands",
}


def missing(bench: Benchmark, python: Path) -> str | None:
    if not python.is_file():
        return f"no {bench.venv} venv at {python} (docs/benchmarks.md says how to make it)"
    for need in bench.needs:
        if not Path(need).expanduser().exists():
            return f"{need} is missing (docs/benchmarks.md says how to build it)"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smallest sizes, results into a scratch folder")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHMARKS], help="these benchmarks only")
    for venv, python in VENVS.items():
        parser.add_argument(f"--{venv}-python", type=Path, default=python, help=f"the {venv} venv's python")
    args = parser.parse_args()
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    scratch = tempfile.mkdtemp(prefix="turnopd-bench-") if args.quick else None
    outcomes: dict[str, str] = {}
    start = time.perf_counter()
    for index, bench in enumerate(chosen, 1):
        python = getattr(args, f"{bench.venv}_python")
        reason = missing(bench, python)
        if reason:
            outcomes[bench.name] = f"skipped: {reason}"
            print(f"[{index}/{len(chosen)}] {bench.name}: {outcomes[bench.name]}", flush=True)
            continue
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **bench.env,
               **({"TURNOPD_BENCH_RESULTS": scratch} if scratch else {})}
        command = bench.command(python, args.quick)
        elapsed = time.perf_counter() - start
        eta = elapsed / (index - 1) * (len(chosen) - index + 1) if index > 1 else None
        print(f"[{index}/{len(chosen)}] {bench.name} ({elapsed / 60:.0f} min so far"
              f"{f', about {eta / 60:.0f} min left' if eta else ''}): {' '.join(command)}", flush=True)
        began = time.perf_counter()
        code = subprocess.call(command, cwd=REPO, env=env)
        outcomes[bench.name] = f"{'ok' if code == 0 else f'FAILED (exit {code})'} in {time.perf_counter() - began:.0f} s"
    print("\nsummary:")
    for name, outcome in outcomes.items():
        print(f"  {name}: {outcome}")
    if scratch:
        print(f"quick results (not published): {scratch}")
    else:
        subprocess.call([sys.executable, "benchmarks/table.py"], cwd=REPO)
    return 1 if any(o.startswith("FAILED") for o in outcomes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
