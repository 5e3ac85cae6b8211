"""A teacher of another family against a teacher of the student's own tokenizer (issue 61's CPU
comparison, docs/results/cross-tokenizer-design.md): the quickstart's tiny student distilled on ALFWorld
from the SmolLM2-135M chat teacher through aligned spans (objective.tokenizers=cross) and from the tiny
800-step teacher (its own tokenizer), the same recipe otherwise.

    python benchmarks/cross_tokenizer.py --seeds 3 --steps 24      # 6 runs, ~1 h on 2 cores

Each run evaluates greedy held-out Avg@1 on the quickstart's 50 held-out games at steps 0, 12 and 24,
and its teacher on them (eval.teacher). The result: each arm's success before and after with 95%
bootstrap intervals over games and seeds, its change paired by game, the arms' difference paired by
game and seed, each arm's per-turn KL at the start and the end, and the work per step, into
benchmarks/results/cross_tokenizer/<tag>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from multi_env import run_arm
from record import interval, pct, points

from turnopd.analysis.frontier import SavedRun, bootstrap_accuracy, bootstrap_difference, load_run
from turnopd.orchestration.recipe import load_recipe

RECIPE = "recipes/alfworld/cross_tokenizer.yaml"
# k1 in both arms as designed (the recipe itself now uses k3: docs/results/2026-12-06-cross-tokenizer.md)
COMMON = ["env.eval_split=valid_unseen+valid_seen+valid_train", "eval.teacher=true", "tracking=[]",
          "checkpoint.every=8", "objective.estimator=k1"]
# not part of the pre-registered comparison (docs/results/cross-tokenizer-design.md, "Exploratory arm"):
# seed 0 only, reported apart
EXPLORATORY = {"smollm2_k3": ["objective.estimator=k3"]}
TINY_BUILDS = "~/.cache/turnopd/models/alfworld-student-sft{steps}"  # teacher_sft.yaml stopped after `steps`
RESULTS = Path(__file__).resolve().parent / "results" / "cross_tokenizer"
KL_STEPS = 4  # the steps averaged for the start and the end of each run's per-turn KL


def arm_result(runs: dict[int, SavedRun]) -> dict:
    """One arm: its teacher, the student before (step 0) and after (the final evaluation) with their
    intervals, the change paired by game and seed, the per-turn KL's start and end, work per step."""
    rng = np.random.default_rng(0)  # its own stream: the same evaluations get the same interval in every arm
    before = {seed: run.evals[0] for seed, run in runs.items()}
    after = {seed: run.final for seed, run in runs.items()}
    kl = {seed: [r.mean_kl for r in run.train] for seed, run in runs.items()}
    return {"teacher": statistics.fmean(run.teacher for run in runs.values()) if all(
                run.teacher is not None for run in runs.values()) else None,
            "before": interval(bootstrap_accuracy(list(before.values()), rng)),
            "after": interval(bootstrap_accuracy(list(after.values()), rng)),
            "change": interval(bootstrap_difference(after, before, rng)),
            "per_seed": {seed: {"before": before[seed].avg_at_k, "after": after[seed].avg_at_k,
                                "curve": {e.step: e.avg_at_k for e in runs[seed].evals},
                                "kl_start": statistics.fmean(kl[seed][:KL_STEPS]),
                                "kl_end": statistics.fmean(kl[seed][-KL_STEPS:]),
                                "train_time_s": run.train_time_s,
                                **drift(run.train),
                                "tokens_scored_per_step": statistics.fmean(r.tokens_scored for r in run.train),
                                "step_time_s_median": statistics.median(r.step_time_s for r in run.train)}
                         for seed, run in runs.items()}}


def drift(train: list) -> dict[str, float]:
    """How the student's play moved (first vs last KL_STEPS steps): tokens generated per turn, the share
    of invalid actions; and the gradient norm before clipping over the run (median, largest)."""
    def mean(records: list, value) -> float:
        return statistics.fmean(value(r) for r in records)

    def per_turn(record) -> float:
        return record.tokens_generated / max(1, record.env_steps)

    first, last = train[:KL_STEPS], train[-KL_STEPS:]
    norms = [r.grad_norm for r in train if r.grad_norm is not None]
    return {"tokens_per_turn_start": mean(first, per_turn), "tokens_per_turn_end": mean(last, per_turn),
            "invalid_start": mean(first, lambda r: r.invalid_action_rate),
            "invalid_end": mean(last, lambda r: r.invalid_action_rate),
            "grad_norm_median": statistics.median(norms), "grad_norm_max": max(norms)}


def page_tables(result: dict) -> str:
    """The results page's tables (docs/results/*-cross-tokenizer.md), generated from the saved result."""
    exploratory = result.get("exploratory", {})
    steps = curve_steps(result)
    rows = ["| arm | teacher (50 games) | student before | after | change (paired by game) |",
            "| --- | --- | --- | --- | --- |"]
    for arm, r in [*result["per_arm"].items(), *((f"{a} (exploratory, seed 0 only)", r) for a, r in exploratory.items())]:
        teacher = f"{100 * r['teacher']:.1f}%" if r["teacher"] is not None else "n/a"
        rows.append(f"| {arm} | {teacher} | {pct(r['before'])} | {pct(r['after'])} | {points(r['change'])} |")
    rows += ["", f"smollm2 minus tiny after {result['steps']} steps (paired by game and seed): "
                 f"**{points(result['smollm2_minus_tiny'], 'points')}**", "",
             "| arm | seed | before | " + " | ".join(f"step {s}" for s in steps) +
             " | KL first 4 steps | KL last 4 steps | s per step (median) | tokens scored per step |",
             "| --- | --- | --- | " + " | ".join("---" for _ in steps) + " | --- | --- | --- | --- |"]
    seeds = [(arm, seed, s) for arm, r in {**result["per_arm"], **{f"{a} (exploratory)": r for a, r in exploratory.items()}
                                           }.items() for seed, s in r["per_seed"].items()]
    for arm, seed, s in seeds:
        curve = " | ".join(f"{100 * s['curve'][str(step)]:.0f}%" if str(step) in s["curve"] else "n/a" for step in steps)
        rows.append(f"| {arm} | {seed} | {100 * s['before']:.0f}% | {curve} | {s['kl_start']:.3f} | "
                    f"{s['kl_end']:.3f} | {s['step_time_s_median']:.1f} | {s['tokens_scored_per_step']:.0f} |")
    rows += ["", "| arm | seed | tokens a turn (first 4 steps -> last 4) | invalid actions | grad norm before clipping "
                 "(median, largest) |", "| --- | --- | --- | --- | --- |"]
    for arm, seed, s in seeds:
        rows.append(f"| {arm} | {seed} | {s['tokens_per_turn_start']:.1f} -> {s['tokens_per_turn_end']:.1f} | "
                    f"{100 * s['invalid_start']:.0f}% -> {100 * s['invalid_end']:.0f}% | "
                    f"{s['grad_norm_median']:.1f}, {s['grad_norm_max']:.1f} |")
    return "\n".join(rows) + "\n"


def ratio_table(ratios: dict) -> str:
    """The teachers' log-ratios on the student's turns (benchmarks/teacher_log_ratios.py's log_ratios.json)."""
    rows = ["| teacher | turns | mean | median | 10th percentile | least | turns below -5 nats |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in ratios["summary"].items():
        rows.append(f"| {name} | {r['turns']} | {r['mean']:.2f} | {r['median']:.2f} | {r['p10']:.2f} | {r['min']:.2f} | "
                    f"{100 * r['share_below_-5']:.0f}% |")
    return "\n".join(rows) + "\n"


def curve_steps(result: dict) -> list[int]:
    """The evaluated steps after the start, as the saved per-seed curves hold them."""
    arms = [*result["per_arm"].values(), *result.get("exploratory", {}).values()]
    steps = {int(step) for r in arms for s in r["per_seed"].values() for step in s["curve"]}
    return sorted(step for step in steps if step > 0)


def tiny_build(steps: int) -> list[str]:
    """The student overrides for the tiny SFT build stopped after `steps` (built on first use)."""
    return [f"student.path={TINY_BUILDS.format(steps=steps)}", f"student.prepare_options.overrides=[trainer.steps={steps}]"]


def tiny_teacher_spec(steps: int, out: Path) -> Path:
    """A teacher spec for the tiny SFT build stopped after `steps` (the student's tokenizer)."""
    path = out / "teachers" / f"tiny-sft{steps}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"name: alfworld-tiny-sft{steps}\nmodel: {Path(TINY_BUILDS.format(steps=steps)).expanduser()}\n"
                    "backend: transformers\ndtype: float32\nmax_length: 512\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("runs/cross_tokenizer"), help="run folders and their recipes")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where <tag>.json is written")
    parser.add_argument("--tag", default="full", help="the results file's name")
    parser.add_argument("--exploratory", action="store_true", help="also run the exploratory arms (seed 0)")
    parser.add_argument("--student-steps", type=int, default=400, help="the student: the tiny SFT build of these steps")
    parser.add_argument("--tiny-teacher-steps", type=int, default=800,
                        help="the tiny teacher: the tiny SFT build of these steps (800: teachers/alfworld/teacher.yaml)")
    parser.add_argument("--page", action="store_true", help="print the results page's tables from the saved result")
    args = parser.parse_args()
    if args.page:
        print(page_tables(json.loads((args.results / f"{args.tag}.json").read_text())))
        print(ratio_table(json.loads((args.results / "log_ratios.json").read_text())), end="")
        return
    overrides = [*COMMON, f"trainer.steps={args.steps}", f"eval.every={max(1, args.steps // 2)}",
                 *tiny_build(args.student_steps)]
    tiny = ("teachers/alfworld/teacher.yaml" if args.tiny_teacher_steps == 800
            else str(tiny_teacher_spec(args.tiny_teacher_steps, args.out)))
    arms = {"smollm2": [], "tiny": [f"teachers.alfworld={tiny}", "objective.tokenizers=match"]}
    recipes = {arm: dataclasses.replace(load_recipe(RECIPE, [*overrides, *extra]), name=f"xtok-{arm}")
               for arm, extra in arms.items()}
    # seed by seed, so an interrupted sweep leaves both arms at the same seeds
    paths = {arm: {} for arm in arms}
    for seed in range(args.seeds):
        for arm, recipe in recipes.items():
            paths[arm][seed] = run_arm(recipe, seed, args.out)
    if args.exploratory:
        for arm, extra in EXPLORATORY.items():
            recipe = load_recipe(RECIPE, [*overrides, *extra])
            paths[arm] = {0: run_arm(dataclasses.replace(recipe, name=f"xtok-{arm}"), 0, args.out)}
    runs = {arm: {seed: load_run(path) for seed, path in by_seed.items()} for arm, by_seed in paths.items()}
    result = {"command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat(),
              "recipe": RECIPE, "overrides": overrides, "arms": arms, "student_steps": args.student_steps, "tiny_teacher_steps": args.tiny_teacher_steps, "seeds": args.seeds, "steps": args.steps,
              "models": {arm: next(iter(by_seed.values())).models for arm, by_seed in runs.items()},
              "per_arm": {arm: arm_result(by_seed) for arm, by_seed in runs.items() if arm in arms},
              "exploratory": {arm: arm_result(by_seed) for arm, by_seed in runs.items() if arm not in arms},
              "smollm2_minus_tiny": interval(bootstrap_difference(
                  {s: r.final for s, r in runs["smollm2"].items()}, {s: r.final for s, r in runs["tiny"].items()}, np.random.default_rng(0)))}
    out = args.results / f"{args.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({arm: {k: v for k, v in r.items() if k != "per_seed"} for arm, r in result["per_arm"].items()}
                     | {"smollm2_minus_tiny": result["smollm2_minus_tiny"]}, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
