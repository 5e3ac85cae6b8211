"""A screenshot student that reads, then acts, distilled from the WebShop text teacher (issue 58,
docs/results/screen-reader-design.md): the page's tables from the saved gates and runs.

    VLLM_CPU_KVCACHE_SPACE=8 turnopd teacher lead recipes/webshop/screen_reader.yaml --min-points 10 \\
        policy.backend=vllm policy.max_batch_size=50 -o benchmarks/results/screen_reader/gate-s4.json
    # each other build tried: its S in the student's folder, overrides and file name
    ... student.path=~/.cache/turnopd/models/webshop-reader-student-sft16 \\
        'student.prepare_options.overrides=[trainer.steps=16]' -o benchmarks/results/screen_reader/gate-s16.json
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 VLLM_CPU_KVCACHE_SPACE=4 \\
        turnopd sweep recipes/webshop/screen_reader.yaml --methods turnopd --seeds 3 --name screen_reader \\
        --out-dir runs/screen_reader policy.backend=vllm policy.max_batch_size=50 checkpoint.every=4
    python benchmarks/screen_reader_distill.py --save runs/screen_reader   # copy the complete runs here
    python benchmarks/screen_reader_distill.py                             # the page's tables

The student is the SFT recipe stopped after S steps: S = 16, then 4, then 0 while the teacher leads it
by less than 10 points; each build tried has its gate file (gate-s<S>.json), reported in that order,
and the first that passes is the student. Primary: the student's greedy Avg@1 on the 100 test goals
after minus before, per goal averaged over the seeds, with its t interval over the goals. Beside it,
per run: the held-out invalid-action rate and mean turns before and after, the step time and its
phases (medians over the steps).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from frontier_alfworld import (
    CHANGE_HEADER,
    change_row,
    complete_runs,
    eval_records,
    gated_page_main,
    step_time_cells,
)

RESULTS = Path(__file__).parent / "results" / "screen_reader"
SWEEP = "screen_reader"  # the sweep's --name: its runs are screen_reader-turnopd-s<seed>


def gates(results: Path) -> list[tuple[int, dict]]:
    """The gate of each student build tried, S (its SFT steps) from the most to the fewest."""
    found = [(int(path.stem.removeprefix("gate-s")), json.loads(path.read_text())) for path in results.glob("gate-s*.json")]
    return sorted(found, key=lambda item: -item[0])


def share(rate: float | None) -> str:
    """A rate (0..1) in percent; n/a for a record from before it was kept."""
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def per_run_table(runs: list) -> list[str]:
    lines = ["| seed | held-out Avg@1 before -> after | invalid actions (held-out) | mean turns (held-out) | "
             "s per step | rollout / teacher / update s |", "| ---: | --- | --- | --- | ---: | --- |"]
    for run in runs:
        before, after = eval_records(run)
        lines.append(
            f"| {run.seed} | {100 * run.evals[0].avg_at_k:.0f}% -> {100 * run.final.avg_at_k:.0f}% | "
            f"{share(before.get('invalid_action_rate'))} -> {share(after.get('invalid_action_rate'))} | "
            f"{before['mean_turns']:.1f} -> {after['mean_turns']:.1f} | {step_time_cells(run)} |")
    return lines


def gate_table(tried: list[tuple[int, dict]]) -> list[str]:
    """One row per student build tried: both players' greedy Avg@1, invalid actions and mean turns on
    the held-out goals, and the lead paired by goal against the bar."""
    lines = ["| student build | goals | teacher: Avg@1 / invalid actions / mean turns | student: Avg@1 / invalid "
             "actions / mean turns | lead (points) [t 95% over goals] | teacher / student ahead | passes |",
             "| --- | ---: | --- | --- | --- | ---: | --- |"]
    for steps, gate in tried:
        env = next(iter(gate["envs"].values()))
        lead = env["lead"]
        teacher, student = (f"{share(env[who]['avg_at_k'])} / {share(env[who].get('invalid_action_rate'))} / "
                            f"{env[who]['mean_turns']:.1f}" for who in ("teacher", "student"))
        lines.append(f"| S = {steps} SFT steps | {lead['tasks']} | {teacher} | {student} | {lead['lead_points']:+.1f} "
                     f"[{lead['interval'][0]:+.1f}, {lead['interval'][1]:+.1f}] | {lead['teacher_ahead']} / "
                     f"{lead['student_ahead']} | {'yes' if gate['passes'] else 'no'} (bar {lead['min_points']:g}) |")
    return lines


def page(results: Path = RESULTS) -> str:
    """Each build's gate; when one passed and runs are saved, each run's figures and the primary row."""
    tried = gates(results)
    if not tried:
        return f"No gate saved in {results} yet: the student has not been built and checked."
    lines = gate_table(tried)
    runs = sorted((r for r in complete_runs(results / "runs") if r.name.startswith(f"{SWEEP}-")), key=lambda r: r.seed)
    if not any(gate["passes"] for _, gate in tried):
        lines += ["", "No build passed the gate: the comparison shows nothing, so no distillation runs."]
    elif runs:
        lines += ["", *per_run_table(runs), "", *CHANGE_HEADER, change_row("TurnOPD", runs)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(gated_page_main(__doc__.splitlines()[0], RESULTS, page))
