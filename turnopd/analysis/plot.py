"""The accuracy-vs-training-time plot of runs (`turnopd frontier`, and each run's own frontier.png).

Figures as defined in turnopd.analysis.frontier.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from turnopd.analysis.frontier import Axis, Comparison, SavedRun, compare, load_run, pareto_front

INTERPOLATION_NOTE = "step-wise interpolation: between evaluations, the last evaluation's Avg@k"


def metric_name(runs: Sequence[SavedRun]) -> str:
    ks = {run.k for run in runs if run.k is not None}
    return f"Avg@{ks.pop()}" if len(ks) == 1 else "Avg@k"


def _x_scale(by: Axis, extent: float) -> tuple[float, str]:
    if by == "step":
        return 1.0, "optimizer step"
    if extent >= 7200:
        return 3600.0, "training wall-clock (h)"
    if extent >= 120:
        return 60.0, "training wall-clock (min)"
    return 1.0, "training wall-clock (s)"


def plot_frontier(cmp: Comparison, runs: Sequence[SavedRun], by: Axis, out: Path) -> None:
    """The frontier figure (frontier_figure) saved as a PNG at `out`."""
    fig = frontier_figure(cmp, runs, by)
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _plot_depth_and_alpha(depth_ax: Any, alpha_ax: Any, run: SavedRun, by: Axis, scale: float, color: str) -> None:
    """One run's rollout-depth cap (solid, probe steps as triangles) and alpha (dashed)."""
    x = [(r.train_time_s if by == "time" else r.step) / scale for r in run.train]
    # a probe step plays at full depth: a mark, not a spike of the cap line
    caps = [None if r.probed else r.rollout_depth_cap for r in run.train]
    alphas = [r.alpha for r in run.train]
    depth_ax.step(x, [c if c is not None else float("nan") for c in caps], where="post", color=color,
                  linewidth=1, alpha=0.8)
    probes = [(xi, r.rollout_depth_cap) for xi, r in zip(x, run.train, strict=True) if r.probed]
    if probes:
        depth_ax.plot(*zip(*probes, strict=True), "v", color=color, markersize=4, alpha=0.8)
    alpha_ax.plot(x, [a if a is not None else float("nan") for a in alphas], "--", color=color,
                  linewidth=1, alpha=0.8)


def frontier_figure(cmp: Comparison, runs: Sequence[SavedRun], by: Axis) -> Any:
    """Panel 1: accuracy vs x per group (seed mean, ± std band across seeds), the teacher's accuracy
    and the Pareto frontier of the plotted points; panel 2: each run's rollout-depth cap (solid;
    probe steps, played at full depth, as triangles) and alpha (dashed, right axis). The legend is
    below both, in columns, so the panels keep the figure's width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale, xlabel = _x_scale(by, max(run.extent(by) for run in runs))
    fig, (acc_ax, depth_ax) = plt.subplots(2, 1, figsize=(13, 8), sharex=True, height_ratios=[3, 2],
                                           layout="constrained")
    alpha_ax = depth_ax.twinx()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    points = []
    for i, row in enumerate(cmp.rows):
        color = colors[i % len(colors)]
        members = row.group.runs
        curve = row.group.curve(by)
        if curve:
            end = max(run.extent(by) for run in members)  # the last value holds until the run's end
            held = [*curve, curve[-1]]
            xs = np.array([p.x for p in curve] + [max(end, curve[-1].x)]) / scale
            means = 100 * np.array([p.mean for p in held])
            stds = 100 * np.array([p.std for p in held])
            label = row.group.label
            if len(members) > 1:
                label += f" (mean of {len(members)} seeds)"
            acc_ax.step(xs, means, where="post", color=color, label=label)
            acc_ax.plot(xs[:-1], means[:-1], "o", color=color, markersize=3)
            if len(members) > 1:
                acc_ax.fill_between(xs, means - stds, means + stds, step="post", color=color, alpha=0.15,
                                    linewidth=0)
            points += [(p.x, p.mean) for p in curve]
        for run in members:
            _plot_depth_and_alpha(depth_ax, alpha_ax, run, by, scale, color)
    teachers = [row.teacher for row in cmp.rows if row.teacher is not None]
    if teachers:
        acc_ax.axhline(100 * sum(teachers) / len(teachers), color="black", linewidth=1, alpha=0.6,
                       label="teacher (same tasks)")
    front = pareto_front(points)
    if front:
        acc_ax.step([x / scale for x, _ in front], [100 * a for _, a in front], where="post", color="black",
                    linestyle=":", linewidth=1.5, label="Pareto frontier")
    marker, marker_label = (cmp.least_time_s, "Least-Time") if by == "time" else (cmp.same_step, "Same-Step")
    acc_ax.axvline(marker / scale, color="grey", linestyle="--", linewidth=0.8, label=f"{marker_label} point")
    acc_ax.set_ylabel(f"{metric_name(runs)} (%)")
    acc_ax.set_title(f"Accuracy vs {'optimizer steps' if by == 'step' else 'training wall-clock'}")
    fig.legend(*acc_ax.get_legend_handles_labels(), title=INTERPOLATION_NOTE, fontsize=8, title_fontsize=8,
               loc="outside lower center", ncols=3)
    acc_ax.grid(alpha=0.3)
    depth_ax.set_ylabel("rollout-depth cap (turns, solid; probe steps ▼)")
    alpha_ax.set_ylabel("alpha (dashed)")
    alpha_ax.set_ylim(-0.05, 1.05)
    depth_ax.set_xlabel(xlabel)
    depth_ax.grid(alpha=0.3)
    return fig


def plot_run(run_dir: Path) -> Path:
    """A run's own plot, <run_dir>/frontier.png, by training wall-clock; returns its path."""
    run = load_run(run_dir)
    out = Path(run_dir) / "frontier.png"
    plot_frontier(compare([run]), [run], "time", out)
    return out
