"""`turnopd frontier RUN...` and `turnopd sweep RECIPE ...`: accuracy vs training wall-clock.

The figures are computed in turnopd.analysis.frontier (definitions there) and drawn by
turnopd.analysis.plot; this module reads the run folders, prints the tables (rich, or markdown with
--md) and saves the PNG.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from turnopd.analysis.frontier import (
    ACCURACY_TOLERANCE,
    TURN_BAND,
    WORK,
    Axis,
    Comparison,
    FrontierError,
    Interval,
    MeanSpread,
    SavedRun,
    compare,
    load_run,
    mixed_builds,
)
from turnopd.analysis.plot import INTERPOLATION_NOTE, metric_name, plot_frontier
from turnopd.core.ledger import RESOURCES
from turnopd.orchestration.sweep import (
    DEFAULT_LAUNCHER,
    SweepError,
    command_for,
    execute_sweep,
    plan_sweep,
    run_state,
)

Rows = list[list[str]]


# ---- formatting -------------------------------------------------------------------------------------


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _accuracy(value: MeanSpread | None, seeds: int) -> str:
    """Percent; a group shows mean ± sample std, and n=m/seeds when only m seeds have a value."""
    if value is None:
        return "–"
    text = f"{100 * value.mean:.1f}"
    if value.n > 1:
        text += f" ± {100 * value.std:.1f}"
    if value.n < seeds:
        text += f" (n={value.n}/{seeds})"
    return text


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _steps(runs: Sequence[SavedRun]) -> str:
    done = min(run.steps_done for run in runs)
    totals = {run.total_steps for run in runs}
    total = max((t for t in totals if t is not None), default=None)
    if all(run.complete for run in runs):
        return str(done)
    return f"{done}/{total if total is not None else '?'} (in progress)"


def _interval(value: Interval | None, sign: bool = False) -> str:
    """An accuracy interval in percent: value [lo, hi]."""
    if value is None:
        return "–"
    return f"{100 * value.value:{'+' if sign else ''}.1f} [{100 * value.lo:.1f}, {100 * value.hi:.1f}]"


def detectable_cell(detectable: float | None, scale: float = 100.0) -> str:
    """The smallest detectable difference (times `scale`: an accuracy in points by default); differences
    with no spread (every seed differed by the same amount, up to float rounding) have no power figure,
    and a "0.0" would read as "detects anything"."""
    if detectable is None:
        return "–"
    return "- (no spread)" if detectable < ACCURACY_TOLERANCE else f"{scale * detectable:.1f}"


def _ratio(value: float | None, interval: tuple[float, float] | None, reached: float | None) -> str:
    if value is None:
        return "not reached"
    text = f"{value:.2f}x"
    if interval is not None:
        text += f" [{interval[0]:.2f}, {interval[1]:.2f}]"
    if reached is not None and reached < 0.95:
        text += f" ({100 * reached:.0f}% of resamples reach it)"
    return text


def accuracy_table(cmp: Comparison, runs: Sequence[SavedRun]) -> tuple[str, list[str], Rows]:
    """Title, headers and rows; the method column only when some run label does not say it."""
    show_method = any(row.group.label != row.group.method for row in cmp.rows)
    target = "–" if cmp.target is None else f"{100 * cmp.target:.1f}%"
    headers = ["run", *(["method"] if show_method else []), "seeds", "steps", "train time", "final [95% CI]",
               f"vs {cmp.baseline.label} [95% CI]", f"same-step @{cmp.same_step}",
               f"least-time @{_duration(cmp.least_time_s)}", f"time to {target}", "speedup [95% CI]",
               "env-step ratio to target [95% CI]"]
    rows = []
    for row in cmp.rows:
        members = row.group.runs
        n = len(members)
        seeds = f"{n} ({','.join(str(run.seed) for run in members if run.seed is not None) or '–'})"
        has_target = cmp.target is not None
        final = _interval(row.final_interval) if row.final_interval else _accuracy(row.final, n)
        work = row.work_ratio.get("env_steps")
        rows.append([
            row.group.label, *([row.group.method] if show_method else []), seeds, _steps(members),
            _duration(row.train_time_s.mean), final, "–" if row.group is cmp.baseline else _interval(row.difference, sign=True),
            _accuracy(row.same_step, n), _accuracy(row.least_time, n),
            "not reached" if has_target and row.time_to_target_s is None else _duration(row.time_to_target_s),
            "1.00x" if row.group is cmp.baseline else (_ratio(row.speedup, row.speedup_interval, row.reached_share)
                                                       if has_target else "–"),
            "1.00x" if row.group is cmp.baseline else (
                "not reached" if has_target and row.time_to_target_s is None else
                _ratio(work.value, (work.lo, work.hi), None) if work else "–"),
        ])
    return f"{metric_name(runs)} (%) vs training wall-clock, against {cmp.baseline.label}", headers, rows


def work_table(cmp: Comparison) -> tuple[str, list[str], Rows]:
    """The work each group did (machine-independent, beside the clock) and what it took to reach the
    baseline's accuracy."""
    headers = ["run", *(f"{w.replace('_', ' ')} (per run)" for w in WORK),
               *(f"{w.replace('_', ' ')} ratio to target" for w in WORK)]
    rows = [[row.group.label, *(f"{row.work.get(w, 0):,.0f}" for w in WORK),
             *("1.00x" if row.group is cmp.baseline else
               (_ratio(row.work_ratio[w].value, (row.work_ratio[w].lo, row.work_ratio[w].hi), None)
                if w in row.work_ratio else "–")
               for w in WORK)] for row in cmp.rows]
    return "Work done (tokens and env steps) and the baseline's work to its accuracy over this run's", headers, rows


def seed_table(cmp: Comparison) -> tuple[str, list[str], Rows]:
    """Against the baseline, paired by seed, with t intervals over seeds: the final difference and
    the smallest one these seeds could detect, accuracy at the baseline's budget (clock and work),
    per-seed clock and work ratios, and the non-inferiority verdict at the margin given."""
    unit = next((row.by_seed.work_unit for row in cmp.rows if row.by_seed), "env_steps").replace("_", " ")
    headers = ["run", "seeds", "final [t 95%]", "vs baseline [t 95%]", "detectable (80% power)",
               "at baseline's clock vs its last", f"at baseline's {unit} vs its last", "clock ratio per seed",
               "clock ratio [t 95%]", f"{unit} ratio [t 95%]"]
    if cmp.margin is not None:
        headers.append(f"non-inferior at {100 * cmp.margin:g} points?")
    rows = []
    for row in cmp.rows:
        s = row.by_seed
        if s is None:
            continue
        work = s.work_ratio.get(s.work_unit)
        rows.append([row.group.label, " ".join(map(str, s.seeds)), _interval(s.final), _interval(s.difference, True),
                     detectable_cell(s.detectable), _interval(s.equal_clock, True),
                     _interval(s.equal_work, True), " ".join(f"{r:.2f}" for r in s.clock_ratio),
                     _ratio(s.clock_ratio_interval.value, (s.clock_ratio_interval.lo, s.clock_ratio_interval.hi), None)
                     if s.clock_ratio_interval else "–",
                     _ratio(work.value, (work.lo, work.hi), None) if work else "–",
                     *([s.verdict or "–"] if cmp.margin is not None else [])])
    return (f"Paired by seed against {cmp.baseline.label} (t intervals over seeds; ratios: the geometric mean over "
            "seeds of the baseline's whole run over this one's)", headers, rows)


def cost_table(cmp: Comparison) -> tuple[str, list[str], Rows]:
    """Where each group's training clock went, and how deep it rolled out."""
    totals: dict[str, float] = {}
    for row in cmp.rows:
        for phase, share in row.phase_shares.items():
            totals[phase] = totals.get(phase, 0.0) + share
    phases = sorted((p for p in totals if p != "other"), key=lambda p: -totals[p]) + (
        ["other"] if "other" in totals else [])
    resources = [r for r in RESOURCES if any(r in row.busy_shares for row in cmp.rows)]
    headers = ["run", "cap", "turns", "deep share", "eval time", *phases, *(f"{r} busy" for r in resources)]
    rows = [[row.group.label, _number(row.mean_cap), _number(row.mean_turns), _share(row.deep_turn_share),
             _duration(row.eval_time_s), *[_share(row.phase_shares.get(p)) for p in phases],
             *[_share(row.busy_shares.get(r)) for r in resources]]
            for row in cmp.rows]
    return "Rollout depth, deep-turn loss share and training clock per ledger phase", headers, rows


def turn_kl_table(cmp: Comparison) -> tuple[str, list[str], Rows]:
    """Each group's teacher-student KL per band of turns: where along the episode the signal is."""
    bands = max((len(row.turn_kl_bands) for row in cmp.rows), default=0)
    headers = ["run", *(f"turns {b * TURN_BAND + 1}-{(b + 1) * TURN_BAND}" for b in range(bands))]

    def cell(kls: list[float], band: int) -> str:
        return f"{kls[band]:.3f}" if band < len(kls) and math.isfinite(kls[band]) else "–"

    rows = [[row.group.label, *(cell(row.turn_kl_bands, b) for b in range(bands))] for row in cmp.rows]
    return "Teacher-student KL per action token, by turn (mean of the per-turn KL profiles)", headers, rows


def familiarity_table(cmp: Comparison) -> tuple[str, list[str], Rows]:
    """Each group's teacher familiarity signals per band of turns, beside the KL table: how familiar
    the states look to the teacher and how sure it is, where along the episode; and the loss weight
    a familiarity weight or gate kept."""
    bands = max((len(v) for row in cmp.rows for v in row.turn_signal_bands.values()), default=0)
    headers = ["run", "signal", *(f"turns {b * TURN_BAND + 1}-{(b + 1) * TURN_BAND}" for b in range(bands)),
               "weight kept"]

    def cell(values: list[float], band: int) -> str:
        return f"{values[band]:.3f}" if band < len(values) and math.isfinite(values[band]) else "–"

    rows = [[row.group.label, name, *(cell(values, b) for b in range(bands)), _share(row.familiarity_kept_share)]
            for row in cmp.rows for name, values in row.turn_signal_bands.items()]
    return ("Teacher familiarity by turn (turnopd.algorithm.familiarity: context_logprob and action_logprob "
            "in nats per token, higher is familiar; action_entropy in nats, lower is surer)", headers, rows)


def notes(cmp: Comparison, runs: Sequence[SavedRun]) -> list[str]:
    splits = sorted({run.split for run in runs if run.split})
    lines = [
        f"{metric_name(runs)} on {', '.join(splits) or 'no evaluation yet'}, in %; a method with several "
        "seeds: mean ± sample std across seeds.",
        f"same-step: at step {cmp.same_step}, the largest step all runs reached; least-time: at "
        f"{_duration(cmp.least_time_s)} of training wall-clock, the shortest any run needed "
        f"({cmp.least_time_run}); {INTERPOLATION_NOTE}.",
    ]
    lines.append("final: the final sampled evaluation where the runs made one (eval.final_k), else the last "
                 "one; its 95% interval and the difference from the baseline's are bootstrap intervals over "
                 "the held-out tasks (paired) and the seeds (2000 resamples).")
    if cmp.target is not None:
        lines.append(f"speedup = {cmp.baseline.label}'s training time to reach the accuracy of its last evaluation "
                     f"({100 * cmp.target:.1f}% at {_duration(cmp.baseline_time_s)}) / the run's time to "
                     "reach it, reached = the first evaluation after step 0 from which the seed-mean accuracy "
                     "stays at or above it; work ratios the same with the work done by then; intervals over "
                     "resampled seeds. The clock on a shared 2-core machine moves ~8% between identical runs; "
                     "the work measures do not.")
    lines.append("paired by seed: over the seeds both groups ran, mean with its 95% t interval over seeds (with "
                 "few seeds a bootstrap over seeds is too narrow); detectable: the smallest true difference a "
                 "two-sided 5% t test on these seeds finds with 80% power; at the baseline's clock / work: each "
                 "seed's last evaluation within the baseline seed's training clock / work, minus the baseline's "
                 "last evaluation; ratios: per seed the baseline seed's whole run over this one's (at equal steps); "
                 "[t 95%]: their geometric mean with the t interval of their logs, so this run's over the "
                 "baseline's is exactly 1/x [1/hi, 1/lo] (docs/frontiers.md, Work ratio)."
                 + (f" Non-inferior at {100 * cmp.margin:g} points: the t interval of the final difference lies above "
                    f"-{100 * cmp.margin:g}; inferior: below it; else inconclusive." if cmp.margin is not None else ""))
    lines.append("cap, turns, deep share: means over training steps of the rollout-depth cap, the turns "
                 "per episode and the deep-turn loss share; eval time: per run, outside the training "
                 "clock; phase columns: share of the training clock (the loop's own phases, which add up); busy "
                 "columns: share of the training clock each resource worked (they overlap).")
    lines += budget_lines(cmp)
    ks = {run.k for run in runs if run.k is not None}
    if len(ks) > 1 or len(splits) > 1:
        lines.append(f"WARNING: runs were evaluated differently (k in {sorted(ks)}, splits {splits}).")
    lines += [f"WARNING: {line}; differences between those runs mix the builds." for line in mixed_builds(runs)]
    return lines


def budget_lines(cmp: Comparison) -> list[str]:
    """Per group that trainer.budget ended: the work achieved against the amount (the comparison is at
    the achieved work)."""
    lines = []
    for row in cmp.rows:
        ended = [run.budget for run in row.group.runs if run.budget]
        if ended:
            over = max(b["spent"] - b["amount"] for b in ended)
            lines.append(f"{row.group.label}: trainer.budget ended {len(ended)} of {len(row.group.runs)} runs; "
                         f"{ended[0]['unit']} achieved {sum(b['spent'] for b in ended) / len(ended):,.0f} per run "
                         f"against {sum(b['amount'] for b in ended) / len(ended):,.0f} budgeted (at most {over:+,.0f}); "
                         "compared at the work achieved.")
    return lines


def _markdown(headers: list[str], rows: Rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def print_report(cmp: Comparison, runs: Sequence[SavedRun], md: bool) -> None:
    tables = [accuracy_table(cmp, runs), work_table(cmp), seed_table(cmp), cost_table(cmp), turn_kl_table(cmp)]
    if any(row.turn_signal_bands for row in cmp.rows):
        tables.append(familiarity_table(cmp))
    if md:
        for title, headers, rows in tables:
            print(f"**{title}**\n\n{_markdown(headers, rows)}\n")
        print("\n".join(f"- {line}" for line in notes(cmp, runs)))
        return
    console = Console()
    for title, headers, rows in tables:
        table = Table(title=title, title_justify="left")
        table.add_column(headers[0], no_wrap=True)
        for h in headers[1:]:
            table.add_column(h)
        for r in rows:
            table.add_row(*r)
        console.print(table)
    for line in notes(cmp, runs):
        console.print(line, highlight=False)


# ---- commands ---------------------------------------------------------------------------------------


def report(run_dirs: Sequence[str | Path], baseline: str | None, md: bool, by: Axis, out: Path,
           margin: float | None = None, work_unit: str = "env_steps", per_seed: Sequence[str] = (),
           env: str | None = None) -> None:
    """Tables on stdout and the PNG at `out`, for the given run folders (`margin` in points; `env`: a
    multi-env run's evaluations of that env alone)."""
    runs = [load_run(d, per_seed, env) for d in run_dirs]
    cmp = compare(runs, baseline, margin=None if margin is None else margin / 100, work_unit=work_unit)
    print_report(cmp, runs, md)
    plot_frontier(cmp, runs, by, out)
    print(f"plot: {out}")


def _default_plot_path(run_dirs: Sequence[str], by: Axis) -> Path:
    """Beside the first run (runs/frontier.png for runs/<name>)."""
    return Path(run_dirs[0]).parent / ("frontier.png" if by == "time" else "frontier-by-step.png")


def frontier(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else _default_plot_path(args.runs, args.by)
    try:
        report(args.runs, args.baseline, args.md, args.by, out, args.margin, args.work_unit, args.per_seed, args.env)
    except FrontierError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def sweep(args: argparse.Namespace) -> int:
    if not Path(args.recipe).is_file():
        print(f"error: recipe file not found: {args.recipe}", file=sys.stderr)
        return 2
    name = args.name or Path(args.recipe).stem
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    launcher = shlex.split(args.launcher) if args.launcher else list(DEFAULT_LAUNCHER)
    try:
        plan = plan_sweep(args.recipe, methods, args.seeds, args.out_dir, name, args.overrides, launcher)
        if args.print_only:
            for run in plan:
                state = run_state(run.run_dir)
                if state == "complete":
                    print(f"# {run.name}: already complete", file=sys.stderr)
                else:
                    print(shlex.join(command_for(run, state)))
            return 0
        outcomes = execute_sweep(plan)
    except (SweepError, FrontierError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    table = Table(title=f"Sweep {name}: {len(plan)} runs", title_justify="left")
    for h in ("run", "method", "seed", "outcome", "time"):
        table.add_column(h)
    for o in outcomes:
        if o.returncode is None:
            outcome = "already complete"
        elif o.returncode == 0 and o.state_after == "complete":
            outcome = "complete" if o.state_before == "new" else "resumed, complete"
        else:
            outcome = f"FAILED: exit {o.returncode}, {o.state_after}"
        table.add_row(o.run.name, o.run.method, str(o.run.seed), outcome, _duration(o.seconds))
    Console().print(table)

    with_metrics = [o.run.run_dir for o in outcomes if o.state_after != "new"]
    if with_metrics:
        out = Path(args.out) if args.out else Path(args.out_dir) / f"{name}-frontier.png"
        try:
            report(with_metrics, args.baseline, args.md, args.by, out, args.margin, args.work_unit, args.per_seed)
        except FrontierError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        print("no run wrote metrics; nothing to compare", file=sys.stderr)
    return 0 if all(o.state_after == "complete" for o in outcomes) else 1


def _add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--baseline", metavar="RUN_OR_METHOD",
                   help="run, method or group the speedup is measured against; a method several groups "
                        "share is refused (default: the vanilla_opd group, else the first group by label)")
    p.add_argument("--md", action="store_true", help="print markdown tables instead of rich ones")
    p.add_argument("--by", choices=("time", "step"), default="time",
                   help="x-axis of the plot: training wall-clock (default) or optimizer steps")
    p.add_argument("--out", metavar="PNG", help="where to save the plot (frontier: beside the first run; "
                   "sweep: OUT_DIR/<name>-frontier.png)")
    p.add_argument("--margin", type=float, metavar="POINTS",
                   help="non-inferiority margin in accuracy points, fixed before the runs: each method is "
                        "non-inferior to the baseline when the t interval of its final difference lies above -POINTS")
    p.add_argument("--work-unit", choices=WORK, default="env_steps",
                   help="the work measure of the equal-budget comparison (default: env_steps)")
    p.add_argument("--per-seed", action="append", default=[], metavar="KEY",
                   help="a config key (dotted) that may differ between the seeds of one group, e.g. "
                        "trainer.budget.amount for an arm whose budget each seed matches to another run's work")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("frontier", help="compare runs: accuracy vs training wall-clock, speedup, Pareto plot")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (runs/<name>); runs in progress work")
    _add_report_args(p)
    p.add_argument("--env", metavar="NAME", help="a multi-env run's frontier of that env alone (its held-out "
                   "success; a single-env run is read as it is); default: the mean over the run's envs")
    p.set_defaults(func=frontier)

    p = sub.add_parser("sweep", help="run one recipe under several methods and seeds, then their frontier")
    p.add_argument("recipe", help="recipe YAML")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides for every run")
    p.add_argument("--methods", default="turnopd,vanilla_opd,tcod",
                   help="comma-separated method names (default: turnopd,vanilla_opd,tcod)")
    p.add_argument("--seeds", type=int, default=1, help="number of seeds per method: 0..N-1 (default 1)")
    p.add_argument("--out-dir", default="runs", help="output_dir of the runs (default: runs)")
    p.add_argument("--name", help="sweep name, the prefix of the run names (default: the recipe's file stem)")
    p.add_argument("--print-only", action="store_true",
                   help="print the command of each run still to do (one per GPU node) and stop")
    p.add_argument("--launcher", metavar="CMD",
                   help="the command that runs one distillation (default: python -m turnopd.cli distill; "
                        "e.g. 'torchrun --nproc-per-node 8 -m turnopd.cli distill')")
    _add_report_args(p)
    p.set_defaults(func=sweep)
