"""World-model rollouts where execution is the cost: vanilla OPD (without and with the reward term)
against world-model rollouts under TurnOPD's and WMRL's corrections, on autoresearch, every job real,
at equal real executions and at equal training clock, 3 seeds per arm.

    python benchmarks/frontier_autoresearch.py                          # both regimes (~1.5 h on 2 cores)
    python benchmarks/frontier_autoresearch.py --regimes equal_executions --seeds 3
    turnopd frontier runs/frontier_autoresearch/equal_clock/*/ --md     # the tables again, from the runs
    python benchmarks/frontier_autoresearch.py --tables benchmarks/results/frontier_autoresearch/equal_clock
    # the 30-task testbed (docs/results/autoresearch-30-design.md: its gate first, then 5 arms x 5 seeds)
    python benchmarks/frontier_autoresearch.py --regimes equal_executions_30,equal_clock_30 --seeds 5

Design (fixed before the runs; docs/results/2026-12-05-autoresearch-frontier.md):
- Recipe: recipes/autoresearch.yaml (the tiny student and teacher), `env.options.disk_cache=false`
  (every job runs, memoised only inside each env worker for the run), 4 episodes a step in groups
  of 2 (the reward term's and the anchors' groups), k1 estimator, greedy Avg@1 on the 6 held-out tasks
  (the test split's first 6 since it grew to 30) at the end only (the start, the same student in every arm, is the autoresearch page's 83.3%).
- Arms (recipes/methods): vanilla_opd, vanilla_opd_reward (reward_weight 0.5),
  vanilla_opd_world_model_reward (the job model, runs/world_models/autoresearch, answers 75% of the
  episodes; ppi and trajectory_variance), vanilla_opd_world_model_wmrl (WMRL's anchors, isotonic map
  and anchor weight). WMRL's schedule is for thousands of groups; these runs see ~8-16, so it is
  scaled: the map from 8 pairs, refitted every 4; the anchor weight's c fixed after 4 groups,
  half-life 8 groups.
- Regimes: equal_executions (trainer.budget: 192 real env steps, the turns of 4 vanilla steps),
  equal_clock (trainer.budget: 150 s of training clock); trainer.steps 40 caps neither.
- Measures: final Avg@1 per arm (mean, t interval over seeds, the smallest difference detectable),
  real env steps (executions), world-model steps, optimizer steps and training clock per run, and
  the isotonic map's bias_stats (centred residual before and after) at each refit.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from frontier_alfworld import by_task, complete_runs, debiasing_table, points, save_runs

from turnopd.analysis.frontier import (
    Comparison,
    Interval,
    compare,
    group_runs,
    load_run,
    mixed_builds,
    reach,
    reach_curve,
    t_interval,
    time_to_reach,
)
from turnopd.commands.frontier import detectable_cell

WORLD_MODEL = "runs/world_models/autoresearch"  # recipes/autoresearch/world_model_job.yaml's output_dir
# The 30-task regimes' builds, kept in the repository: a machine emptied between sittings would
# otherwise build them again, differently (the expert's jobs, hence its demonstrations, differ a little
# from one machine to the next), and its runs could not join the earlier ones
BUILDS = Path(__file__).parent / "results" / "frontier_autoresearch" / "builds"
BUILD_FOLDERS = {"teacher": "runs/teachers/autoresearch", "job_model": WORLD_MODEL,
                 "student": "~/.cache/turnopd/models/autoresearch-student-sft50"}
# Every regime's shared settings: the job model's WMRL schedule scaled to runs of ~10-60 steps
SHARED = ["env.options.disk_cache=false", "trainer.episodes_per_step=4", "trainer.group_size=2",
          "objective.estimator=k1", "checkpoint.every=8", "tracking=[]",
          "world_model.calibration_min_pairs=8", "world_model.calibration_refit_every=4",
          "world_model.anchor_warmup_groups=4", "world_model.anchor_half_life=8"]
# The 2026-12-05 design: 6 tasks, no start or teacher evaluation, the final one only
FIRST = [*SHARED, "trainer.steps=40", "eval.at_start=false", "eval.every=1000", "eval.teacher=false",
         "eval.max_tasks=6"]
# docs/results/autoresearch-30-design.md: the 30 test tasks, each run's start and teacher evaluated, and
# the student its gate chose (the 50-step stop of the teacher's recipe, built on first use)
ON_30 = [*SHARED, "trainer.steps=60", "eval.at_start=true", "eval.teacher=true",
         "student.path=~/.cache/turnopd/models/autoresearch-student-sft50",
         "student.prepare_options.overrides=[trainer.steps=50]"]
FIRST_ARMS = "vanilla_opd,vanilla_opd_reward,vanilla_opd_world_model_reward,vanilla_opd_world_model_wmrl"
ARMS_30 = "vanilla_opd,turnopd,vanilla_opd_reward,vanilla_opd_world_model_reward,vanilla_opd_world_model_wmrl"
REGIMES = {  # regime -> (its arms, its overrides)
    "equal_executions": (FIRST_ARMS, [*FIRST, "trainer.budget.unit=env_steps", "trainer.budget.amount=192"]),
    "equal_clock": (FIRST_ARMS, [*FIRST, "trainer.budget.unit=train_time_s", "trainer.budget.amount=150"]),
    "equal_executions_30": (ARMS_30, [*ON_30, "trainer.budget.unit=env_steps", "trainer.budget.amount=480",
                                      "eval.every=4"]),
    "equal_clock_30": (ARMS_30, [*ON_30, "trainer.budget.unit=train_time_s", "trainer.budget.amount=240",
                                 "eval.every=0"]),
}


def sync_builds() -> None:
    """Each build of BUILD_FOLDERS: copied from BUILDS where the folder is missing, copied to BUILDS
    where the folder exists and BUILDS has none; where both exist their weights must be the same."""
    import shutil

    from turnopd.models import weights_fingerprint

    for name, folder in BUILD_FOLDERS.items():
        saved, live = BUILDS / name, Path(folder).expanduser()
        if saved.is_dir() and not live.exists():
            shutil.copytree(saved, live)
            print(f"== {name}: restored {live} from {saved}", flush=True)
        elif live.is_dir() and not saved.exists():
            shutil.copytree(live, saved, ignore=shutil.ignore_patterns("*.tmp", "__pycache__"))
            print(f"== {name}: saved {live} to {saved} (commit it)", flush=True)
        elif live.is_dir() and weights_fingerprint(live) != weights_fingerprint(saved):
            raise SystemExit(f"{live} is not the build saved in {saved} (weights {weights_fingerprint(live)} against "
                             f"{weights_fingerprint(saved)}): move it aside to use the saved one")


def work_table(runs_dir: Path) -> None:
    """Per arm, means over its seeds: optimizer steps, real env steps, world-model steps, training
    clock, and with isotonic the last refit's bias_stats (before -> after) and the map's fits."""
    print("| arm | seeds | steps | real env steps | world-model steps | training clock (s) | "
          "isotonic bias before -> after (fits) | anchor weight |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    groups: dict[str, list] = {}
    for run in complete_runs(runs_dir):
        groups.setdefault(run.method, []).append(run)
    for method, runs in groups.items():
        def mean(values: list[float]) -> float:
            return statistics.fmean(values) if values else float("nan")

        steps = mean([len(run.train) for run in runs])
        env = mean([sum(r.env_steps or 0 for r in run.train) for run in runs])
        model = mean([sum(r.world_model_steps or 0 for r in run.train) for run in runs])
        clock = mean([run.train_time_s for run in runs])
        lasts = [run.train[-1] for run in runs if run.train]
        fitted = [r for r in lasts if r.world_model_bias_before is not None]
        bias = (f"{mean([r.world_model_bias_before for r in fitted]):.3f} -> "
                f"{mean([r.world_model_bias_after for r in fitted]):.3f} ({len(fitted)} of {len(runs)} fitted)"
                if fitted else "-")
        weights = [r.world_model_anchor_weight for r in lasts if r.world_model_anchor_weight is not None]
        weight = f"{mean(weights):.2f}" if weights else "-"
        print(f"| {method} | {len(runs)} | {steps:.1f} | {env:.0f} | {model:.0f} | {clock:.0f} | {bias} | {weight} |")


def bias_over_training(runs_dir: Path) -> None:
    """The isotonic arm's bias_stats by step (means over the seeds whose map is fitted by then):
    WMRL's centred residual of the model's verdicts against the real outcomes over the map's pairs,
    before and after the map, and the anchor weight."""
    runs = [run for run in complete_runs(runs_dir) if run.method == "vanilla_opd_world_model_wmrl"]
    if not runs:
        return
    print("| step | seeds fitted | bias before | bias after | anchor weight |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for step in range(1, max(len(run.train) for run in runs) + 1):
        records = [r for run in runs for r in run.train if r.step == step]
        fitted = [r for r in records if r.world_model_bias_before is not None]
        weights = [r.world_model_anchor_weight for r in records if r.world_model_anchor_weight is not None]
        before = f"{statistics.fmean(r.world_model_bias_before for r in fitted):.3f}" if fitted else "-"
        after = f"{statistics.fmean(r.world_model_bias_after for r in fitted):.3f}" if fitted else "-"
        weight = f"{statistics.fmean(weights):.2f}" if weights else "-"
        print(f"| {step} | {len(fitted)} of {len(records)} | {before} | {after} | {weight} |")


# docs/results/autoresearch-30-design.md's primary comparisons: (arm, its baseline)
COMPARISONS_30 = (("vanilla_opd_world_model_reward", "vanilla_opd_reward"),
                  ("vanilla_opd_world_model_wmrl", "vanilla_opd_reward"), ("turnopd", "vanilla_opd"))


def called(seeds: Interval, tasks: Interval | None) -> str:
    """The design's rule: a difference is called only when both intervals (over seeds, over tasks)
    exclude 0 on the same side. Intervals of no width at 0 mean every seed and every task differed by
    exactly 0: said so, since no power figure applies to differences with no spread."""
    if (seeds.lo, seeds.hi) == (0, 0) and tasks is not None and (tasks.lo, tasks.hi) == (0, 0):
        return "equal in every seed and task"
    for sign, word in ((1, "ahead"), (-1, "behind")):
        if sign * seeds.lo > 0 and tasks is not None and sign * tasks.lo > 0 and sign * tasks.hi > 0:
            return word
    return "no difference at this power"


def tables_30(regime: str, runs_dir: Path) -> str:
    """A 30-task regime's results tables from its complete runs (docs/results/autoresearch-30-design.md):
    the checks (one build of the code and each model, the teacher's lead at the start, the budgets),
    each arm's start, final and work, the primary comparisons paired by seed and clustered at the task,
    and the real executions each arm needed to reach vanilla OPD's final accuracy."""
    runs = [run for p in sorted(runs_dir.glob("*/metrics.jsonl")) if (run := load_run(p.parent)).complete]
    if not runs:
        raise SystemExit(f"no complete runs under {runs_dir}")
    groups = {group.method: group for group in group_runs(runs)}
    codes = sorted({run.code or "not recorded" for run in runs})
    starts = [run.evals[0].avg_at_k for run in runs if run.evals and run.evals[0].step == 0]
    teachers = [run.teacher for run in runs if run.teacher is not None]
    budgets = [run.budget for run in runs if run.budget]
    unit = budgets[0]["unit"] if budgets else None
    over = [b["spent"] - b["amount"] for b in budgets]
    lines = [f"- Complete runs: {len(runs)}; seeds per arm: "
             + "; ".join(f"{m} {len(g.runs)}" for m, g in groups.items()) + ".",
             f"- Builds: code {', '.join(codes)}; models: " + ("; ".join(mixed_builds(runs)) or "one build of each (" + ", ".join(
                 f"{role} {model['weights']}" for role, model in runs[0].models.items()) + ")") + ".",
             f"- At the start: the student {100 * statistics.fmean(starts):.1f}% (range {100 * min(starts):.1f}-"
             f"{100 * max(starts):.1f}, {len(starts)} runs), the teacher {100 * statistics.fmean(teachers):.1f}% "
             f"(range {100 * min(teachers):.1f}-{100 * max(teachers):.1f}, {len(teachers)} runs)."
             if starts and teachers else "- At the start: not evaluated in these runs.",
             f"- Budgets ({unit}): {len(budgets)} of {len(runs)} runs ended by theirs, past it by "
             f"{min(over, default=0):+.0f} to {max(over, default=0):+.0f}.", "",
             "| arm | seeds | final Avg@1 [t 95%] | real env steps | world-model steps | optimizer steps | training clock (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for method, group in groups.items():
        final = t_interval([run.final.avg_at_k for run in group.runs])
        interval = "-" if final is None else f"{100 * final.value:.1f} [{100 * final.lo:.1f}, {100 * final.hi:.1f}]"
        env = statistics.fmean(run.work_by(math.inf)["env_steps"] for run in group.runs)
        model = statistics.fmean(sum(t.world_model_steps or 0 for t in run.train) for run in group.runs)
        steps = statistics.fmean(len(run.train) for run in group.runs)
        clock = statistics.fmean(run.train_time_s for run in group.runs)
        lines.append(f"| {method} | {len(group.runs)} | {interval} | {env:.0f} | {model:.0f} | {steps:.1f} | {clock:.0f} |")
    lines += ["", "| comparison (paired) | seeds | difference, points [t 95% over seeds] | detectable | "
                  "over the tasks [t 95%] | called (both intervals) |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    against = {base: compare(runs, baseline=groups[base].label)  # one comparison (its bootstraps) per baseline
               for base in {base for _, base in COMPARISONS_30} | {"vanilla_opd"} if base in groups}
    for arm, base in COMPARISONS_30:
        if arm not in groups or base not in groups:
            continue
        row = next(r for r in against[base].rows if r.group.method == arm)
        d, tasks = row.by_seed.difference, by_task(groups[arm].runs, groups[base].runs)
        if d is None:
            continue
        lines.append(f"| {arm} - {base} | {len(row.by_seed.seeds)} | {points(d)} | {detectable_cell(row.by_seed.detectable)} | "
                     f"{'-' if tasks is None else points(tasks)} | {called(d, tasks)} |")
    reference = against.get("vanilla_opd")
    along_the_way = all(len(run.evals) > 2 for run in runs)  # equal clock evaluates at the start and end only
    if reference is not None and reference.target is not None and along_the_way:
        lines += ["", *executions_to_target(reference)]
    return "\n".join(lines) + "\n"


def executions_to_target(reference: Comparison) -> list[str]:
    """The real executions each arm needed to reach vanilla OPD's final accuracy (`reference`: the
    comparison against vanilla OPD, whose target that is), the optimizer step it was reached at beside
    the arm's first evaluation, and the work ratio with its share of resamples where both reach it."""
    lines = [f"Real executions to reach vanilla OPD's final greedy Avg@1 ({100 * reference.target:.1f}%, "
             "the seed-mean curves; ratio = vanilla's executions / the arm's, 95% over resampled seeds; "
             "an arm reaching it at its first evaluation may have reached it sooner, which the "
             "evaluations' spacing cannot show):", "",
             "| arm | executions to reach it | at optimizer step (first evaluation) | ratio [95%] | "
             "resamples where both reach it |", "| --- | ---: | ---: | ---: | ---: |"]
    for row in reference.rows:
        _, work = reach(row.group.runs, reference.target)
        step = time_to_reach(reach_curve(row.group.runs, "step"), reference.target)
        first = min(e.step for run in row.group.runs for e in run.evals if e.step > 0)
        r = row.work_ratio.get("env_steps")
        executions = "not reached" if work is None else f"{work['env_steps']:.0f}"
        lines.append(f"| {row.group.method} | {executions} | {'-' if step is None else f'{step:.0f}'} ({first}) | "
                     f"{'-' if r is None else f'{r.value:.2f}x [{r.lo:.2f}, {r.hi:.2f}]'} | "
                     f"{'-' if row.reached_share is None else f'{100 * row.reached_share:.0f}%'} |")
    return lines


def print_tables(runs_dir: Path) -> None:
    work_table(runs_dir)
    debiasing_table(runs_dir)
    bias_over_training(runs_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regimes", default="equal_executions,equal_clock", help=f"comma-separated: {', '.join(REGIMES)}")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--methods", help="comma-separated arms (recipes/methods); default: the regime's")
    p.add_argument("--out-dir", default="runs/frontier_autoresearch")
    p.add_argument("--save-to", default="benchmarks/results/frontier_autoresearch",
                   help="where each complete run's metrics.jsonl and config.yaml are copied")
    p.add_argument("--tables", metavar="DIR", help="only print the work, debiasing and bias tables of the runs in DIR")
    p.add_argument("--page", metavar="REGIME", help="print a 30-task regime's results tables from its saved runs "
                   "(under --save-to) and run nothing")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every run")
    args = p.parse_args()
    if args.tables:
        print_tables(Path(args.tables))
        return 0
    if args.page:
        print(tables_30(args.page, Path(args.save_to) / args.page), end="")
        return 0
    unknown = sorted(set(args.regimes.split(",")) - set(REGIMES))
    if unknown:
        p.error(f"unknown regimes {unknown}; known: {', '.join(REGIMES)}")
    start, code = time.perf_counter(), 0
    on_30 = any(regime.endswith("_30") for regime in args.regimes.split(","))
    if on_30:
        sync_builds()
    if not Path(WORLD_MODEL, "world_model.json").is_file():
        print(f"== building the job model {WORLD_MODEL}", flush=True)
        code = subprocess.call([sys.executable, "-m", "turnopd.cli", "world-model", "train",
                                "recipes/autoresearch/world_model_job.yaml"])
        if on_30:
            sync_builds()
    for regime in args.regimes.split(","):
        out_dir = Path(args.out_dir) / regime
        arms, overrides = REGIMES[regime]
        command = [sys.executable, "-m", "turnopd.cli", "sweep", "recipes/autoresearch.yaml", "--methods",
                   args.methods or arms, "--seeds", str(args.seeds), "--name", regime, "--out-dir", str(out_dir),
                   "--md", "--out", str(out_dir / "frontier.png"), *overrides, *args.overrides]
        print(f"== regime {regime}\n$ " + " ".join(command), flush=True)
        code = subprocess.call(command) or code
        if on_30:
            sync_builds()  # a student or teacher the first run built
        print_tables(out_dir)
        save_runs(out_dir, Path(args.save_to) / regime)
    print(f"experiment finished in {(time.perf_counter() - start) / 60:.1f} min (exit {code})")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
