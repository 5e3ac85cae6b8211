"""What a person watching a run sees: a rich progress bar per optimizer step, one per evaluation's
episodes, and a closing summary. Written to a log (not a terminal) the bars become lines: one per
step, with its ETA, and one every EpisodeProgress.every_s seconds of an evaluation."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.errors import LiveError
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from turnopd.core.metrics import StepRecord
from turnopd.core.tracking import TRACKERS
from turnopd.core.types import Trajectory, describe_env_errors

console = Console()


def progress_bar(label: str, fields: str, **kwargs: Any) -> Progress:
    """A rich bar: label, bar, k/N, the task's `fields` (a format string), elapsed and ETA."""
    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn(fields),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), **kwargs)


class StepProgress:
    """step k/K, depth cap, alpha, training success, tokens/s, elapsed and ETA."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.enabled, self.start_step, self.clock = enabled, start_step, clock
        self.started = clock()
        if not enabled:
            return
        self._progress = progress_bar(
            "distill", "cap {task.fields[cap]} | alpha {task.fields[alpha]} | success {task.fields[success]} | "
                       "kl {task.fields[kl]} | {task.fields[tps]} tok/s", console=console)
        self._task = self._progress.add_task("distill", total=total_steps, completed=start_step, cap="-",
                                             alpha="-", success="-", kl="-", tps="-")
        self._progress.start()

    def update(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        step_time = sum(record.phases.values()) or 1e-9
        per_env = (record.per_env or {}).values()  # a multi-env run: each env's cap and success, in recipe order
        cap = "/".join(str(env["rollout_depth_cap"]) for env in per_env) or record.rollout_depth_cap
        success = "/".join(f"{env['success_rate']:.2f}" for env in per_env) or f"{record.success_rate:.2f}"
        fields = dict(cap=cap, alpha=f"{record.alpha:.2f}", success=success,
                      kl=f"{record.mean_kl:.3f}", tps=f"{(record.tokens_generated + record.tokens_trained) / step_time:.0f}")
        self._progress.update(self._task, completed=record.step, **fields)
        if not console.is_terminal:  # a log file gets a line per step instead of a redrawn bar
            total = int(self._progress.tasks[0].total)
            per_step = (self.clock() - self.started) / max(record.step - self.start_step, 1)  # this launch's pace
            console.print(f"step {record.step}/{total}: " + ", ".join(f"{k} {v}" for k, v in fields.items()) +
                          f", {record.wall_time_s:.0f} s, ETA {duration(per_step * (total - record.step))}",
                          soft_wrap=True)  # one line in a log, however long
        if record.env_failures:  # one unwrapped line; a message may hold [brackets], which are not markup
            console.print(f"step {record.step}: {describe_env_errors(record.env_errors, record.episodes)}",
                          style="yellow", markup=False, soft_wrap=True)

    def close(self) -> None:
        if self.enabled:
            self._progress.stop()


def duration(seconds: float) -> str:
    """45 s, 12.5 min, 3.2 h."""
    return f"{seconds:.0f} s" if seconds < 100 else f"{seconds / 60:.1f} min" if seconds < 6000 else \
        f"{seconds / 3600:.1f} h"


class EpisodeProgress:
    """The episodes of an evaluation or a step's rollout as they end: done/total, won, rate and ETA;
    a rich bar in a terminal, else a line every `every_s` seconds and one at the end (none for what
    ends sooner). Use as a context manager and pass `episode_done` to the rollout."""

    def __init__(self, label: str, total: int, enabled: bool = True, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.enabled, self.every_s, self.clock = label, total, enabled, every_s, clock
        self.done = self.won = 0
        self.started = self.last_line = clock()
        self._bar = progress_bar(label, "won {task.fields[won]}", console=console, transient=True) \
            if enabled and console.is_terminal else None
        if self._bar is not None:
            self._task = self._bar.add_task(label, total=total, won=0)

    def __enter__(self) -> EpisodeProgress:
        if self._bar is not None:
            try:
                self._bar.start()
            except LiveError:  # rich < 14 nests no live display (the step's bar is one): lines instead
                self._bar = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    def episode_done(self, trajectory: Trajectory) -> None:
        if not self.enabled:
            return
        self.done += 1
        self.won += bool(trajectory.success)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, won=self.won)
            return
        now = self.clock()
        last_of_a_long_one = self.done == self.total and now - self.started >= self.every_s
        if now - self.last_line >= self.every_s or last_of_a_long_one:
            self.last_line = now
            console.print(self.line(now), markup=False, soft_wrap=True)

    def line(self, now: float) -> str:
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = duration((self.total - self.done) / rate) if rate else "-"
        return (f"{self.label}: {self.done}/{self.total} episodes, {self.won} won, {60 * rate:.1f} episodes/min, "
                f"{duration(elapsed)} so far, ETA {eta}")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_summary(cfg, summary: dict[str, Any]) -> None:
    """Held-out success before/after next to the teacher's, the clocks, and where the time went."""
    before, after, teacher = summary.get("eval_before"), summary.get("eval_after"), summary.get("teacher_eval")
    table = Table(title=f"{cfg.name}: {summary['steps']} steps, {cfg.env.name} "
                        f"{after.split if after else ''} Avg@{cfg.eval.k}", show_lines=False)
    table.add_column("")
    table.add_column("held-out success", justify="right")
    table.add_column("mean turns", justify="right")
    if teacher is not None:
        table.add_row("teacher", _pct(teacher.avg_at_k), f"{teacher.mean_turns:.1f}")
    if before is not None:
        table.add_row("student before", _pct(before.avg_at_k), f"{before.mean_turns:.1f}")
    if after is not None:
        table.add_row("student after", _pct(after.avg_at_k), f"{after.mean_turns:.1f}")
    if before is not None and after is not None:
        table.add_row("change", f"{100 * (after.avg_at_k - before.avg_at_k):+.1f} pts", "")
    console.print(table)
    for who, result in (("teacher", teacher), ("student before", before), ("student after", after)):
        if result is not None and result.env_failures:
            console.print(f"{who}: {result.describe_env_failures()} (counted as lost)", style="yellow", markup=False,
                          soft_wrap=True)
    if after is not None and after.per_type:
        console.print("per task type (after): " + ", ".join(f"{k} {_pct(v)}" for k, v in after.per_type.items()))
    phases = summary["phases"]
    total = sum(phases.values()) or 1e-9
    console.print(f"training clock {summary['train_time_s']:.0f} s, wall clock {summary['wall_time_s']:.0f} s; "
                  "time by phase: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in
                                                sorted(phases.items(), key=lambda kv: -kv[1])))
    outputs = ["metrics.jsonl", "config.yaml", "checkpoints/", "frontier.png",
               *(TRACKERS.get(name).output for name in cfg.tracking)]
    console.print(f"run folder: {summary['run_dir']} ({', '.join(outputs)})")
