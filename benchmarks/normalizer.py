"""AsyncWebRL's constant normalizer against vanilla OPD's per-trajectory mean, on the quickstart's
ALFWorld task (docs/results/normalizer-design.md): the design's tables from its saved runs.

    turnopd teacher lead recipes/quickstart.yaml -o benchmarks/results/normalizer/gate.json
    turnopd sweep recipes/quickstart.yaml --methods vanilla_opd_reward,asyncwebrl_constant_reward --seeds 5 \\
        --name normalizer --out-dir runs/normalizer trainer.group_size=2 trainer.steps=24 objective.estimator=k1 eval.every=8
    python benchmarks/normalizer.py --save runs/normalizer   # copy the complete runs' records into the results folder
    python benchmarks/normalizer.py                 # the page's tables, from the saved gate and runs

Primary (both paired): the won training episodes' mean turns over steps 17-24, the constant arm minus
the per-trajectory one, t interval over seeds ("contracts" when it lies below 0); the final greedy
Avg@1 on the 50 held-out games, the same difference per game averaged over seeds, t interval over
games (non-inferior when its lower end is above -10 points).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

from frontier_alfworld import by_task, complete_runs, gated_page_main, points
from record import gate_line

from turnopd.analysis.frontier import detectable_effect, non_inferiority, t_interval
from turnopd.commands.frontier import detectable_cell

RESULTS = Path(__file__).parent / "results" / "normalizer"
PER_TRAJECTORY, CONSTANT = "vanilla_opd_reward", "asyncwebrl_constant_reward"  # 1/|tau_i|, then 1/k
LATE = range(17, 25)  # the design's window for the turns of won and lost episodes
MARGIN = 0.10  # non-inferiority margin on held-out Avg@1


@functools.cache  # each table cell reads one field: parse each run's records once
def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def late_mean(run_dir: Path, key: str) -> float | None:
    """The mean over steps 17-24 of a train record field (steps where it is None, e.g. no episode
    won, left out); None when no step has it."""
    values = [r[key] for r in records(run_dir, "train") if r["step"] in LATE and r.get(key) is not None]
    return statistics.fmean(values) if values else None


def per_run_table(arms: dict[str, list]) -> list[str]:
    lines = ["| arm | seed | won: mean turns (steps 17-24) | lost: mean turns | invalid actions | success | "
             "held-out Avg@1 at steps 0 / 8 / 16 / 24 | held-out mean turns at the end |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for arm, runs in arms.items():
        for run in runs:
            cells = [late_mean(run.path, key) for key in ("mean_turns_won", "mean_turns_lost", "invalid_action_rate",
                                                           "success_rate")]
            curve = " / ".join(f"{100 * e.avg_at_k:.0f}%" for e in run.evals)
            lines.append(f"| {arm} | {run.seed} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells)
                         + f" | {curve} | {records(run.path, 'eval')[-1]['mean_turns']:.1f} |")
    return lines


def primary_lines(arms: dict[str, list]) -> list[str]:
    base = {run.seed: run for run in arms[PER_TRAJECTORY]}
    pairs = [(run, base[run.seed]) for run in arms[CONSTANT] if run.seed in base]
    lines = [f"| {CONSTANT} - {PER_TRAJECTORY} (paired) | seeds | difference [t 95%] | detectable (80% power) | called |",
             "| --- | ---: | ---: | ---: | --- |"]
    for key, words in (("mean_turns_won", ("contracts", "lengthens")), ("mean_turns_lost", ("shorter", "longer"))):
        diffs = [a - b for a, b in ((late_mean(x.path, key), late_mean(y.path, key)) for x, y in pairs)
                 if a is not None and b is not None]
        d = t_interval(diffs)
        if d is None:
            lines.append(f"| {key}, steps 17-24 | {len(diffs)} | - | - | fewer than 2 seeds with the figure |")
            continue
        called = (words[0] if d.hi < 0 else words[1] if d.lo > 0
                  else "equal in every seed" if d.lo == d.hi == 0 else "no difference at this power")
        lines.append(f"| {key}, steps 17-24 (turns) | {len(diffs)} | {d.value:+.2f} [{d.lo:+.2f}, {d.hi:+.2f}] | "
                     f"{detectable_cell(detectable_effect(diffs), scale=1)} | {called} |")
    seeds = t_interval([x.final.avg_at_k - y.final.avg_at_k for x, y in pairs])
    games = by_task(arms[CONSTANT], arms[PER_TRAJECTORY])
    lines += ["", f"Final held-out Avg@1, {CONSTANT} - {PER_TRAJECTORY}: over the games (per game averaged over "
                  f"the seeds) {points(games)} points, over the seeds {points(seeds)}: "
                  f"{non_inferiority(games, MARGIN)} at {100 * MARGIN:.0f} points."]
    return lines


def page(results: Path = RESULTS) -> str:
    """The page's tables: the gate, then (when it passed) each run's figures (the training episodes' over
    steps 17-24, the held-out curve and the last evaluation's mean turns) and the primary comparisons."""
    gate = json.loads((results / "gate.json").read_text())
    lines = [gate_line(gate)]
    if gate["passes"]:
        runs = complete_runs(results / "runs")
        arms = {arm: sorted((r for r in runs if r.method == arm), key=lambda r: r.seed) for arm in (PER_TRAJECTORY, CONSTANT)}
        lines += ["", *per_run_table(arms), "", *primary_lines(arms)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(gated_page_main(__doc__.splitlines()[0], RESULTS, page))
