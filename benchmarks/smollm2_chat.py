"""A real chat model distilled as a chat agent (issue 56, docs/results/smollm2-chat-design.md):
SmolLM2-135M-Instruct on the quickstart's ALFWorld task, each episode one conversation
(prompt.style=chat) against the paper's fresh prompt per turn (history_block): the page's tables from
the saved gate and runs.

    VLLM_CPU_KVCACHE_SPACE=8 turnopd teacher lead recipes/alfworld/smollm2_chat.yaml policy.backend=vllm \\
        policy.max_batch_size=50 -o benchmarks/results/smollm2_chat/gate.json
    turnopd sweep recipes/alfworld/smollm2_chat.yaml --methods turnopd --seeds 3 --name smollm2_chat \\
        --out-dir runs/smollm2_chat
    turnopd sweep recipes/alfworld/smollm2_chat.yaml --methods turnopd --seeds 3 --name smollm2_history \\
        --out-dir runs/smollm2_chat prompt.style=history_block
    python benchmarks/smollm2_chat.py --save runs/smollm2_chat   # copy the complete runs into the results folder
    python benchmarks/smollm2_chat.py               # the page's tables, from the saved gate and runs

Primary, per arm: the student's greedy Avg@1 on the 50 held-out games after minus before, per game
averaged over the seeds, with its t interval over the games. Secondary: chat minus history_block after,
paired the same way; per run the held-out mean turns, the training invalid-action rate, the step time
and its phases (medians over the steps), the tokens the teacher scored per env step and the peak host
memory (the run's last record).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from frontier_alfworld import (
    CHANGE_HEADER,
    by_task,
    change_row,
    complete_runs,
    eval_records,
    gated_page_main,
    points,
    step_time_cells,
)
from record import gate_line

RESULTS = Path(__file__).parent / "results" / "smollm2_chat"
ARMS = {"chat": "smollm2_chat", "history_block": "smollm2_history"}  # the arm: its sweep's --name


def arm_runs(runs: list) -> dict[str, list]:
    """The complete runs of each arm (its sweep's runs are named <sweep>-<method>-s<seed>), by seed."""
    return {arm: sorted((r for r in runs if r.name.startswith(f"{sweep}-")), key=lambda r: r.seed)
            for arm, sweep in ARMS.items()}


def per_run_table(arms: dict[str, list]) -> list[str]:
    lines = ["| arm | seed | held-out Avg@1 before -> after | held-out mean turns | invalid actions (training) | "
             "s per step | rollout / teacher / update s | teacher tokens per env step | peak host memory (MiB) |",
             "| --- | ---: | --- | --- | ---: | ---: | --- | ---: | ---: |"]
    for arm, runs in arms.items():
        for run in runs:
            before, after = (r["mean_turns"] for r in eval_records(run))
            lines.append(
                f"| {arm} | {run.seed} | {100 * run.evals[0].avg_at_k:.0f}% -> {100 * run.final.avg_at_k:.0f}% | "
                f"{before:.1f} -> {after:.1f} | {100 * statistics.fmean(r.invalid_action_rate for r in run.train):.1f}% | "
                f"{step_time_cells(run)} | "
                f"{sum(r.tokens_scored for r in run.train) / max(1, sum(r.env_steps for r in run.train)):.0f} | "
                f"{run.train[-1].peak_memory_mib.get('host', float('nan')):.0f} |")
    return lines


def primary_lines(arms: dict[str, list]) -> list[str]:
    lines = [*CHANGE_HEADER, *(change_row(arm, runs) for arm, runs in arms.items())]
    chat, history = arms["chat"], arms["history_block"]
    if chat and history:
        lines += ["", f"chat minus history_block after (per game averaged over the seeds both ran): "
                      f"**{points(by_task(chat, history))} points**."]
    return lines


def page(results: Path = RESULTS) -> str:
    """The gate, then (when it passed and runs are saved) each run's figures and the comparisons."""
    gate = json.loads((results / "gate.json").read_text())
    lines = [gate_line(gate)]
    arms = arm_runs(complete_runs(results / "runs"))
    if gate["passes"] and any(arms.values()):
        lines += ["", *per_run_table(arms), "", *primary_lines(arms)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(gated_page_main(__doc__.splitlines()[0], RESULTS, page))
