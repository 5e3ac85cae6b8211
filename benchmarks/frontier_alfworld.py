"""The headline experiment: TurnOPD against vanilla OPD and the baselines on real ALFWorld games, in
two regimes, at least 3 seeds per arm, paired (same models, tasks and seeds), run interleaved.

    python benchmarks/frontier_alfworld.py                    # both regimes, 3 seeds (hours on 2 cores)
    python benchmarks/frontier_alfworld.py --regimes headroom --seeds 3
    python benchmarks/frontier_alfworld.py --regimes world_model --methods vanilla_opd,vanilla_opd_world_model
    turnopd frontier runs/frontier_alfworld/headroom/*/ --md  # the tables again, from the runs alone
    python benchmarks/frontier_alfworld.py --page equal_budget_30  # an equal-budget regime's page tables, from its saved runs

Regimes (both on recipes/quickstart.yaml: the tiny teacher, look_at_obj_in_light train games for
rollouts, all 50 held-out games of that type for evaluation, greedy Avg@1 every 8 steps and a
final sampled Avg@4 at the rollouts' temperature):
- headroom: the 400-step student (34% held-out against the teacher's 70%, ~30-turn episodes),
  48 steps of 8 episodes; arms vanilla_opd, turnopd, fixed_cap (25 turns), curriculum_trajectory
  (TCOD's curriculum with vanilla OPD's loss; its saved runs carry its earlier name, headroom-tcod-s*),
  turnopd_continuous (an eighth of every step's episodes as probes) and tcod_f2b (TCOD-F2B as its code
  runs, docs/baselines.md, at the curriculum interval of 1 step: TCOD's 6 is for 250 steps and reaches
  its horizon at 70% of them, and only 1 reaches the 40-turn horizon within 48 steps, at step 39).
- headroom_tcod: headroom's settings, the TCOD arms on one build of the models: tcod_f2b (TCOD as its
  code runs) against curriculum_trajectory (the arm headroom saved as tcod) and vanilla_opd.
- paper: closer to the paper's: the 250-step student (it won 12%, 25% and 31% of its first three
  steps' 16 training episodes at H_max 50; the 350-step student won 38-56%), H_max 50, 32 steps of
  16 episodes, so that a probe batch holds 16 probes; arms vanilla_opd, turnopd, turnopd_continuous.
- familiarity: headroom's settings; turnopd against turnopd with a familiarity weight and gate on
  the teacher's action entropy (recipes/methods/turnopd_familiarity_*.yaml, turnopd.algorithm.familiarity).
- world_model: vanilla_opd and turnopd, each without and with world-model rollouts
  (recipes/methods/*_world_model.yaml; the world model of recipes/alfworld/world_model.yaml, built
  first when missing) at 0 and 0.25 s of simulated latency per real env request, 8 steps, held-out
  Avg@1 at the end.
- world_model_twin: world_model's world-model arms at latency 0 with the twin verdict
  (world_model.verdict=twin: a model episode of each real episode's task beside it measures the
  model's bias in the closed loop); the verdict does not touch training, so the runs train as
  world_model's do, and the held-out evaluation is cut to one game (eval.max_tasks=1). Ends with the
  debiasing table: the step means of success_rate_debiased against success_rate_real.
- equal_budget: the pre-registered headline comparison (docs/results/equal-budget-design.md): 20
  optimizer steps of 8 episodes (where headroom's greedy curves still rise), greedy Avg@1 every 4
  steps and the final sampled Avg@4; arms vanilla_opd and turnopd, then per seed the equal-work
  control: vanilla OPD stopped by trainer.budget at the env steps that seed's TurnOPD run played
  (its runs are named equal_budget-vanilla_opd_at_turnopd_work-s<seed>); at least 8 seeds
  (--seeds 8). Ends with `turnopd frontier --margin 5` against the control, then vanilla_opd.
- equal_budget_30: equal_budget at power (docs/results/equal-budget-30-design.md): the same arms on
  seeds 0-29 (--seeds 30), all on one build; the control may run up to 40 steps, so that its env-step
  budget ends it (in equal_budget, two seeds' TurnOPD runs outplayed vanilla's 20 steps).
- relabelled_teacher: headroom's settings, turnopd from the SFT teacher (sweep expert_teacher) and
  from the teacher made familiar with the student's states (sweep relabelled_teacher:
  recipes/alfworld/teacher_dagger.yaml, built on first use), same seeds, then one frontier of both.

Each regime is one `turnopd sweep` or more (turnopd.orchestration.sweep: seed 0 of every arm, then seed 1, ...;
a run's line gives the sweep's elapsed time and ETA; a sweep started again skips complete runs and
resumes an interrupted one from its last checkpoint), then `turnopd frontier` on its runs. The runs
the docs/results pages report are copied (metrics and configs) into benchmarks/results/frontier_alfworld/<regime>/
(`--save-to`) as each regime ends, so `turnopd frontier` regenerates the tables from them alone.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from turnopd.analysis.frontier import (
    BOOTSTRAP,
    Interval,
    compare,
    detectable_effect,
    load_run,
    mixed_builds,
    non_inferiority,
    percentile_interval,
    t_interval,
)
from turnopd.commands.frontier import detectable_cell
from turnopd.orchestration.sweep import run_state

WORLD_MODEL = "runs/world_models/alfworld"  # recipes/alfworld/world_model.yaml's output_dir, which
# recipes/methods/*_world_model.yaml name (built first when missing)
COMMON = ["eval.every=8", "eval.final_k=4", "eval.temperature=0.5", "eval.teacher=true", "checkpoint.every=8",
          "tracking=[]"]
# regime: its sweeps, each (sweep name, methods, overrides); runs are named <sweep>-<method>-s<seed>
REGIMES = {
    "headroom": [("headroom", "vanilla_opd,turnopd,fixed_cap,curriculum_trajectory,turnopd_continuous,tcod_f2b", [])],
    "headroom_tcod": [("headroom_tcod", "vanilla_opd,curriculum_trajectory,tcod_f2b", [])],
    "familiarity": [("familiarity", "turnopd,turnopd_familiarity_weight,turnopd_familiarity_gate", [])],
    "relabelled_teacher": [("expert_teacher", "turnopd", []),
                           ("relabelled_teacher", "turnopd", ["teachers.alfworld=teachers/alfworld/teacher_dagger.yaml"])],
    # world-model rollouts (turnopd.rollout.world_model_pool) against real ones, at no added env latency and at
    # 0.25 s a real env request (env.step_latency_s: a stand-in for a remote sandbox); 8 steps, the
    # held-out greedy Avg@1 at the end only (every evaluation plays the real env, latency included)
    "world_model": [(f"world_model_latency{latency}", "vanilla_opd,vanilla_opd_world_model,turnopd,turnopd_world_model", [
        f"env.step_latency_s={latency}", "trainer.steps=8", "eval.at_start=false", "eval.teacher=false",
        "eval.final_k=null"]) for latency in ("0", "0.25")],
    "world_model_twin": [("world_model_twin_latency0", "vanilla_opd_world_model,turnopd_world_model", [
        "env.step_latency_s=0", "trainer.steps=8", "eval.at_start=false", "eval.teacher=false", "eval.final_k=null",
        "eval.max_tasks=1", "world_model.verdict=twin"])],
    "equal_budget": [("equal_budget", "vanilla_opd,turnopd", ["trainer.steps=20", "eval.every=4"])],
    # the headline at power (docs/results/equal-budget-30-design.md): equal_budget's arms on 30 seeds
    "equal_budget_30": [("equal_budget_30", "vanilla_opd,turnopd", ["trainer.steps=20", "eval.every=4"])],
    "paper": [("paper", "vanilla_opd,turnopd,turnopd_continuous", [
        "student.path=~/.cache/turnopd/models/alfworld-student-sft250",
        "student.prepare_options.overrides=[trainer.steps=250]", "env.max_turns=50",
        "trainer.steps=32", "trainer.episodes_per_step=16"])],
}


EQUAL_BUDGET_MARGIN = 5.0  # points of Avg@4, fixed before the runs (2.5 of the 50 held-out games)


EQUAL_WORK_REGIMES = {"equal_budget": [], "equal_budget_30": ["trainer.steps=40"]}  # the control's own overrides:
# equal_budget_30's control may run past 20 steps, so that its budget, not the step count, ends it


def equal_work_control(regime: str, out_dir: Path, seeds: int, overrides: list[str]) -> int:
    """An equal-budget regime's third arm: per seed, vanilla OPD with trainer.budget = the env steps
    that seed's TurnOPD run played (a run already complete is skipped, an interrupted one resumed)."""
    code = 0
    for seed in range(seeds):
        turnopd = load_run(out_dir / f"{regime}-turnopd-s{seed}")
        name = f"{regime}-vanilla_opd_at_turnopd_work-s{seed}"
        state = run_state(out_dir / name)
        if state == "complete":
            continue
        command = [sys.executable, "-m", "turnopd.cli", "distill", "recipes/quickstart.yaml", "--resume",
                   str(out_dir / name)] if state == "incomplete" else [
            sys.executable, "-m", "turnopd.cli", "distill", "recipes/quickstart.yaml"]
        command[5:5] = [f"name={name}", f"seed={seed}", f"output_dir={out_dir}", "depth.mode=full",
                        "loss.mode=trajectory", *COMMON, *REGIMES[regime][0][2], *EQUAL_WORK_REGIMES[regime],
                        "trainer.budget.unit=env_steps",
                        f"trainer.budget.amount={turnopd.work_by(math.inf)['env_steps']:.0f}", *overrides]
        print("$ " + " ".join(command), flush=True)
        code = subprocess.call(command) or code
    return code


def save_runs(runs_dir: Path, save_dir: Path) -> None:
    """Copy each complete run's metrics.jsonl and config.yaml (all `turnopd frontier` reads)."""
    for run in sorted(p.parent for p in runs_dir.glob("*/metrics.jsonl")):
        if run_state(run) != "complete":
            continue  # interrupted: the sweep resumes it next time
        (save_dir / run.name).mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "config.yaml"):
            shutil.copy2(run / name, save_dir / run.name / name)
    print(f"saved the complete runs of {runs_dir} to {save_dir}")


def gated_page_main(description: str, results: Path, page) -> int:
    """The command line of a gated experiment's page script: `--save RUNS_DIR` copies its sweeps'
    complete runs into results/runs first; then the page's tables (`page()`) are printed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--save", type=Path, metavar="RUNS_DIR", help=f"copy the sweeps' complete runs (config.yaml, "
                        f"metrics.jsonl) into {results}/runs, then print the tables")
    args = parser.parse_args()
    if args.save:
        save_runs(args.save, results / "runs")
    print(page())
    return 0


def complete_runs(runs_dir: Path) -> list:
    """The complete runs (final evaluation written) in runs_dir, by folder name."""
    return [run for path in sorted(runs_dir.glob("*/metrics.jsonl")) if (run := load_run(path.parent)).complete]


def world_model_pairs(runs_dir: Path) -> None:
    """Each arm against its world-model twin, per latency, paired by seed: training time (mean), the
    per-seed ratio plain / world model (median and range: > 1 means world-model rollouts are faster),
    real env steps, world-model episode steps and the world model's verdict steps per run."""
    by_key = {(run.name.split("-")[0], run.method, run.seed): run for run in complete_runs(runs_dir)}
    print("| sweep | arm | training time (mean) | plain / world model, per seed | real env / world-model episode / "
          "verdict steps |")
    print("| --- | --- | ---: | ---: | ---: |")
    plain_arms = sorted({(sweep, method) for sweep, method, _ in by_key if not method.endswith("_world_model")})
    for sweep, method in plain_arms:
        for arm in (method, f"{method}_world_model"):
            seeds = sorted(s for (w, m, s) in by_key if (w, m) == (sweep, arm))
            group = [by_key[(sweep, arm, s)] for s in seeds]
            if not group:
                continue
            steps = {key: statistics.fmean(sum(getattr(r, key) or 0 for r in run.train) for run in group)
                     for key in ("env_steps", "world_model_steps", "world_model_verdict_steps")}
            ratios = sorted(by_key[(sweep, method, s)].train_time_s / by_key[(sweep, arm, s)].train_time_s
                            for s in seeds if (sweep, method, s) in by_key)
            ratio = "" if arm == method or not ratios else (
                f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}, {len(ratios)} seeds)")
            print(f"| {sweep} | {arm} | {statistics.fmean(r.train_time_s for r in group):.1f} s | {ratio} | "
                  f"{steps['env_steps']:,.0f} / {steps['world_model_steps']:,.0f} / "
                  f"{steps['world_model_verdict_steps']:,.0f} |")


def debiasing_table(runs_dir: Path, seed: int = 0) -> None:
    """Online Debiasing against the real env, per world-model arm: over every step with both (of all
    seeds), the means of success_rate_real (the real episodes') and success_rate_debiased (the model
    episodes' success minus the bias the verdicts measured), the mean bias, and the mean per-step
    difference debiased - real with a 95% bootstrap interval over (seed, step) pairs: an interval
    that covers 0 says the debiased rate tracks the real one at this power."""
    print("| run group | verdict | steps | success_rate_real | success_rate_debiased | world_model_bias | "
          "debiased - real [95% CI] |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    groups: dict[str, list] = {}
    for run in complete_runs(runs_dir):
        if "_world_model" in run.method:
            groups.setdefault(run.name.rsplit("-s", 1)[0], []).append(run)
    for name, group in groups.items():
        steps = [r for run in group for r in run.train if r.success_rate_debiased is not None]
        if not steps:
            continue
        real = np.array([r.success_rate_real for r in steps])
        debiased = np.array([r.success_rate_debiased for r in steps])
        gaps, rng = debiased - real, np.random.default_rng(seed)
        low, high = percentile_interval([float(np.mean(rng.choice(gaps, size=len(gaps)))) for _ in range(BOOTSTRAP)])
        verdict = OmegaConf.load(group[0].path / "config.yaml").world_model.get("verdict", "last_turn")
        print(f"| {name} | {verdict} | {len(steps)} | {real.mean():.1%} | {debiased.mean():.1%} | "
              f"{np.mean([r.world_model_bias for r in steps]):+.3f} | "
              f"{points(Interval(float(gaps.mean()), low, high))} |")


def difference_words(difference: Interval, margin: float) -> str:
    """A paired difference (Avg@k units) in the words its t interval allows, with the non-inferiority
    verdict at `margin` (docs/frontiers.md)."""
    shown = ("ahead: the interval lies above 0" if difference.lo > 0 else "behind: the interval lies below 0"
             if difference.hi < 0 else "difference not shown: the interval holds 0")
    return f"{shown}; {non_inferiority(difference, margin)} at the {100 * margin:g}-point margin"


def equal_budget_tables(regime: str, runs_dir: Path) -> str:
    """An equal-budget regime's results tables from its complete runs: the checks its design asks for
    (one build of the code and of each model, budgets held to one episode), each arm's final Avg@k and
    work, and the comparisons paired by seed: primary TurnOPD against the equal-work control, secondary
    against vanilla OPD at equal steps (docs/results/equal-budget-30-design.md)."""
    runs = [run for p in sorted(runs_dir.glob("*/metrics.jsonl"))
            if (run := load_run(p.parent, ["trainer.budget.amount"])).complete]
    margin = EQUAL_BUDGET_MARGIN / 100
    control, vanilla = f"{regime}-vanilla_opd_at_turnopd_work", f"{regime}-vanilla_opd"
    primary, secondary = (compare(runs, baseline=base, margin=margin) for base in (control, vanilla))
    rows = {row.group.label: row for row in primary.rows}
    turnopd = next(label for label, row in rows.items() if row.group.method == "turnopd")
    controls = rows[control].group.runs
    episode = max(OmegaConf.load(run.path / "config.yaml").env.max_turns for run in controls)  # the bound on overshoot
    over = [run.budget["spent"] - run.budget["amount"] for run in controls if run.budget]
    codes = sorted({run.code or "not recorded" for run in runs})
    lines = [f"- Complete runs: {len(runs)}; seeds per arm: "
             + "; ".join(f"{label} {len(row.group.runs)}" for label, row in rows.items()) + ".",
             f"- Builds: code {', '.join(codes)}; models: "
             + ("; ".join(mixed_builds(runs)) or "one build of each (" + ", ".join(
                 f"{role} {model['weights']}" for role, model in runs[0].models.items()) + ")") + ".",
             f"- The control's budgets: {len(over)} of {len(controls)} runs ended by theirs, "
             f"at most {max(over, default=0):+.0f} env steps past it (one episode: {episode}).", "",
             "| arm | seeds | final Avg@k mean [t 95%] | env steps per run | tokens trained per run |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for label, row in rows.items():
        final = t_interval([run.final.avg_at_k for run in row.group.runs])
        lines.append(f"| {label} | {len(row.group.runs)} | {100 * final.value:.1f} [{100 * final.lo:.1f}, "
                     f"{100 * final.hi:.1f}] | {row.work['env_steps']:,.0f} | {row.work['tokens_trained']:,.0f} |")
    lines += ["", "| comparison (paired by seed) | seeds | difference, points [t 95%] | detectable | "
                  "env-step ratio, baseline / other [t 95%] | in words | by task [t 95%] | tasks and seeds resampled [95%] |",
              "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for name, cmp, label in (("**primary:** TurnOPD - the equal-work control", primary, turnopd),
                             ("secondary: TurnOPD - vanilla OPD, equal steps", secondary, turnopd),
                             ("vanilla OPD, equal steps - the equal-work control", primary, vanilla)):
        row = next(row for row in cmp.rows if row.group.label == label)
        s, both = row.by_seed, row.difference
        d, r, t = s.difference, s.work_ratio["env_steps"], by_task(row.group.runs, cmp.baseline.runs)
        lines.append(f"| {name} | {len(s.seeds)} | {points(d)} | {100 * s.detectable:.1f} | "
                     f"{r.value:.2f}x [{r.lo:.2f}, {r.hi:.2f}] | {difference_words(d, margin)} | {points(t)} | "
                     f"{points(both)} |")
    return "\n".join(lines) + "\n"


def points(d: Interval) -> str:
    """A difference of Avg@k (0..1) in signed points with its interval: +2.0 [+0.1, +3.9]."""
    return f"{100 * d.value:+.1f} [{100 * d.lo:+.1f}, {100 * d.hi:+.1f}]"


def by_task(runs: list, base: list) -> Interval:
    """The paired final difference clustered at the held-out task: per task, this group's final score
    minus the baseline's, averaged over the seeds both ran; their mean with its t interval over the
    tasks (other games would give other numbers, as other seeds do)."""
    base_final = {run.seed: run.final.per_task for run in base}
    return t_interval(game_differences([(run.final.per_task, base_final[run.seed]) for run in runs if run.seed in base_final]))


def game_differences(pairs: list[tuple[dict[str, float], dict[str, float]]]) -> list[float]:
    """Per game (by name), the first score minus the second averaged over the pairs (one a seed)."""
    return [statistics.fmean(ours[task] - theirs[task] for ours, theirs in pairs) for task in sorted(pairs[0][1])]


CHANGE_HEADER = ["| arm | seeds | after - before, per task averaged over the seeds [t 95% over tasks] | "
                 "detectable (80% power) | called |", "| --- | ---: | --- | ---: | --- |"]


def change_row(arm: str, runs: list) -> str:
    """An arm's primary row: its runs' held-out score after minus before (their first evaluation), per
    task averaged over the seeds, with its t interval over the tasks and the smallest detectable effect."""
    differences = game_differences([(run.final.per_task, run.evals[0].per_task) for run in runs])
    change = t_interval(differences)
    called = ("improves" if change.lo > 0 else "worsens" if change.hi < 0
              else "unchanged in every task" if change.lo == change.hi == 0 else "no difference at this power")
    return (f"| {arm} | {len(runs)} | {points(change)} points | {detectable_cell(detectable_effect(differences))} | "
            f"{called} |")


def step_time_cells(run) -> str:
    """A run's step time and its phases in seconds, medians over its steps, as table cells:
    `step | rollout / teacher / update` (rollout with the depth controller's probes, update the
    forward-backward and the optimizer)."""
    def median(value) -> float:
        return statistics.median(value(r) for r in run.train)

    return (f"{median(lambda r: r.step_time_s):.0f} | "
            f"{median(lambda r: r.phases.get('rollout', 0.0) + r.phases.get('probe', 0.0)):.0f} / "
            f"{median(lambda r: r.train_parts.get('teacher', 0.0)):.0f} / "
            f"{median(lambda r: r.train_parts.get('forward_backward', 0.0) + r.train_parts.get('optimizer', 0.0)):.0f}")


def eval_records(run) -> tuple[dict, dict]:
    """A run's held-out evaluation records (metrics.jsonl), before (step 0) and after (the last)."""
    evals = [r for r in map(json.loads, (run.path / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    return evals[0], evals[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated: {', '.join(REGIMES)}")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--methods", help="only these of each regime's arms (comma-separated)")
    p.add_argument("--out-dir", default="runs/frontier_alfworld")
    p.add_argument("--save-to", default="benchmarks/results/frontier_alfworld",
                   help="where each complete run's metrics.jsonl and config.yaml are copied")
    p.add_argument("--page", metavar="REGIME", help="print an equal-budget regime's results tables from its saved "
                   "runs (under --save-to) and run nothing")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every run")
    args = p.parse_args()
    if args.page:
        print(equal_budget_tables(args.page, Path(args.save_to) / args.page), end="")
        return 0
    start, code = time.perf_counter(), 0
    arms = {m for regime in args.regimes.split(",") for _, methods, _ in REGIMES[regime] for m in methods.split(",")}
    chosen = set(args.methods.split(",")) if args.methods else arms
    if not chosen <= arms:
        p.error(f"--methods: {', '.join(sorted(chosen - arms))} not among the regimes' arms {', '.join(sorted(arms))}")
    if any(r.startswith("world_model") for r in args.regimes.split(",")) and \
            not Path(WORLD_MODEL, "world_model.json").is_file():
        print(f"== building the world model {WORLD_MODEL}", flush=True)
        code = subprocess.call([sys.executable, "-m", "turnopd.cli", "world-model", "train",
                                "recipes/alfworld/world_model.yaml"])
    for regime in args.regimes.split(","):
        out_dir = f"{args.out_dir}/{regime}"
        for sweep, methods, overrides in REGIMES[regime]:
            methods = ",".join(m for m in methods.split(",") if m in chosen)
            if not methods:
                continue
            plot = "frontier.png" if len(REGIMES[regime]) == 1 else f"{sweep}-frontier.png"
            command = [sys.executable, "-m", "turnopd.cli", "sweep", "recipes/quickstart.yaml", "--methods", methods,
                       "--seeds", str(args.seeds), "--name", sweep, "--out-dir", out_dir, "--md",
                       "--out", f"{out_dir}/{plot}", *COMMON, *overrides, *args.overrides]
            print(f"== regime {regime}, sweep {sweep}\n$ " + " ".join(command), flush=True)
            code = subprocess.call(command) or code
        if len(REGIMES[regime]) > 1:  # the sweeps' runs side by side, against the first sweep's first method
            # named by its seed-0 run: the sweeps share methods, so a method would match several groups
            first_sweep, first_methods, _ = REGIMES[regime][0]
            baseline = f"{first_sweep}-{next(m for m in first_methods.split(',') if m in chosen)}-s0"
            command = [sys.executable, "-m", "turnopd.cli", "frontier", *sorted(str(p.parent) for p in
                       Path(out_dir).glob("*/metrics.jsonl")), "--md", "--baseline", baseline,
                       "--out", f"{out_dir}/frontier.png"]
            print(f"== regime {regime}: all its runs\n$ " + " ".join(command), flush=True)
            code = subprocess.call(command) or code
        if regime in EQUAL_WORK_REGIMES:
            code = equal_work_control(regime, Path(out_dir), args.seeds, args.overrides) or code
            # the control's seeds differ only in their matched budget: one group. The primary comparison
            # is against it, the secondary against vanilla OPD at equal steps
            for baseline in (f"{regime}-vanilla_opd_at_turnopd_work", f"{regime}-vanilla_opd"):
                command = [sys.executable, "-m", "turnopd.cli", "frontier", *sorted(str(p.parent) for p in
                           Path(out_dir).glob("*/metrics.jsonl")), "--md", "--baseline", baseline,
                           "--per-seed", "trainer.budget.amount", "--margin", str(EQUAL_BUDGET_MARGIN),
                           "--out", f"{out_dir}/frontier.png"]
                print("$ " + " ".join(command), flush=True)
                code = subprocess.call(command) or code
        if regime == "world_model":
            world_model_pairs(Path(out_dir))
        if regime.startswith("world_model"):
            debiasing_table(Path(out_dir))
        save_runs(Path(out_dir), Path(args.save_to) / regime)
    print(f"experiment finished in {(time.perf_counter() - start) / 60:.1f} min (exit {code})")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
