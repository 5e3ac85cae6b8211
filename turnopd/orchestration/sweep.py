"""`turnopd sweep`: one recipe under several methods and seeds, one run after another.

Each run is a subprocess

    <launcher> RECIPE name=<sweep>-<method>-s<seed> seed=<seed> output_dir=<DIR>
               tracker.group=<sweep> tracker.tags=[<method>] <method overrides> <overrides>

with the launcher `python -m turnopd.cli distill` by default (a cluster launcher such as
`torchrun --nproc-per-node 8 -m turnopd.cli distill` works the same way). The run's folder
<DIR>/<name> says where it stands, so a sweep started again resumes: a complete run (final
evaluation written) is skipped, an incomplete one is continued with `--resume <DIR>/<name>`, a new
one starts. A run that fails is reported and the sweep goes on with the next.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from turnopd.analysis.frontier import load_run
from turnopd.config import override_key
from turnopd.core.methods import METHODS

DEFAULT_LAUNCHER = (sys.executable, "-m", "turnopd.cli", "distill")
# keys the sweep sets per run; a user override of one would make the runs collide
PER_RUN_KEYS = ("name", "seed", "output_dir", "tracker.group", "tracker.tags")

RunState = Literal["new", "incomplete", "complete"]


class SweepError(ValueError):
    """A sweep that cannot be planned: names the method, seed count or override at fault."""


@dataclass(frozen=True)
class PlannedRun:
    name: str
    method: str
    seed: int
    run_dir: Path
    argv: tuple[str, ...]  # the command that starts it (a resume appends --resume run_dir)


@dataclass(frozen=True)
class RunOutcome:
    run: PlannedRun
    state_before: RunState
    returncode: int | None  # None: skipped, already complete
    state_after: RunState
    seconds: float


def run_name(sweep: str, method: str, seed: int) -> str:
    return f"{sweep}-{method}-s{seed}"


def plan_sweep(recipe: str, methods: Sequence[str], seeds: int, out_dir: str | Path, sweep: str,
               overrides: Sequence[str] = (), launcher: Sequence[str] = DEFAULT_LAUNCHER) -> list[PlannedRun]:
    """The runs of a sweep, interleaved: seed 0 of every method, then seed 1, ... (so that a drift of
    the machine's speed hits every method alike, and a cut-short sweep has every method). Method
    overrides come before the user's, which may tune anything else."""
    if not methods:
        raise SweepError("--methods: give at least one method")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SweepError(f"unknown method(s) {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    if len(set(methods)) < len(methods):
        raise SweepError(f"--methods lists a method twice: {', '.join(methods)}")
    if seeds < 1:
        raise SweepError(f"--seeds must be at least 1, got {seeds}")
    if not sweep or "/" in sweep:
        raise SweepError(f"sweep name {sweep!r} must be a non-empty folder-name prefix without '/'")
    malformed = [o for o in overrides if "=" not in o]
    if malformed:
        raise SweepError(f"overrides must be key=value, got {malformed}")
    method_keys = {override_key(o) for m in methods for o in METHODS[m]}
    clashing = [o for o in overrides if override_key(o) in (*PER_RUN_KEYS, *method_keys)]
    if clashing:
        raise SweepError(f"override(s) {', '.join(clashing)} would overrule what the sweep sets per run "
                         f"({', '.join((*PER_RUN_KEYS, *sorted(method_keys)))}); "
                         "use --name, --out-dir, --seeds or --methods instead")
    plan = []
    for seed in range(seeds):
        for method in methods:
            name = run_name(sweep, method, seed)
            argv = (*launcher, str(recipe), f"name={name}", f"seed={seed}", f"output_dir={out_dir}",
                    f"tracker.group={sweep}", f"tracker.tags=[{method}]", *METHODS[method], *overrides)
            plan.append(PlannedRun(name, method, seed, Path(out_dir) / name, argv))
    return plan


def run_state(run_dir: Path) -> RunState:
    """new: no metrics yet (nothing to resume); complete: the final evaluation is written."""
    if not (run_dir / "metrics.jsonl").is_file():
        return "new"
    return "complete" if load_run(run_dir).complete else "incomplete"


def command_for(run: PlannedRun, state: RunState) -> list[str]:
    return [*run.argv, "--resume", str(run.run_dir)] if state == "incomplete" else list(run.argv)


def _run_subprocess(argv: list[str]) -> int:
    return subprocess.run(argv).returncode  # the run's own output goes straight to the terminal


def execute_sweep(plan: Sequence[PlannedRun], log: Callable[[str], None] = print,
                  run_command: Callable[[list[str]], int] = _run_subprocess) -> list[RunOutcome]:
    """Run the plan in order; a failed run is logged and the sweep continues. Each run's line says
    the sweep's elapsed time and an ETA (the mean time of the runs it played, times those left)."""
    outcomes = []
    start, played = time.monotonic(), []
    for i, run in enumerate(plan, 1):
        tag = f"[{i}/{len(plan)}] {run.name}"
        before = run_state(run.run_dir)
        if before == "complete":
            log(f"{tag}: already complete, skipped")
            outcomes.append(RunOutcome(run, before, None, before, 0.0))
            continue
        argv = command_for(run, before)
        log(f"{tag}: {'resuming' if before == 'incomplete' else 'starting'}: {shlex.join(argv)}")
        t0 = time.monotonic()
        returncode = run_command(argv)
        seconds = time.monotonic() - t0
        after = run_state(run.run_dir)
        ok = returncode == 0 and after == "complete"
        verdict = "done" if ok else f"FAILED (exit {returncode}, run {after})"
        played.append(seconds)
        left = sum(run_state(r.run_dir) != "complete" for r in plan[i:])
        eta = sum(played) / len(played) * left
        log(f"{tag}: {verdict} in {seconds:.1f} s; sweep {(time.monotonic() - start) / 60:.1f} min, "
            f"ETA {eta / 60:.1f} min for {left} runs")
        outcomes.append(RunOutcome(run, before, returncode, after, seconds))
    return outcomes
