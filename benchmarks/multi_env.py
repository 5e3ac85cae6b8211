"""One generalist against two specialists (issue 60's CPU demonstration, docs/results/multi-env-design.md):
a tiny student distilled on ALFWorld (the quickstart's look_at_obj_in_light games) and multi-hop search
from their two tiny teachers in one run (recipes/multi/alfworld_search.yaml), against two single-env
runs of the same student, one per env, at the same episodes of each env (so the same total episodes).

    python benchmarks/multi_env.py                       # 3 seeds x 3 arms, 48 steps (hours on 2 cores;
                                                         # the first run builds the three models)
    python benchmarks/multi_env.py --seeds 1 --steps 2 --smoke --out /tmp/multi_env --results /tmp/multi_env
                                                         # ~6 min: tiny random models, 2 held-out tasks an env

Arms, every one derived from the one recipe, so they differ only in their envs:
- mixture: the recipe as it is, 8 episodes a step, 4 of each env, each scored by its env's teacher.
- alfworld, search: the recipe as that env alone sees it (turnopd.config.env_views: its env block and
  its 4 episodes a step) with its own teacher only: as many steps, so each env's episodes are the
  mixture's and the two runs together play the mixture's total.
Each run evaluates greedy held-out Avg@1 on its env's first eval.max_tasks held-out tasks (the same
tasks in every arm), and its teacher on them (eval.teacher). The result, per env: each arm's final
held-out success with a 95% bootstrap interval over tasks and seeds, the mixture's difference from the
specialist paired by task and seed, and the work (env steps, tokens generated and trained, training
seconds: the mixture's one run against the two single-env runs together), into
benchmarks/results/multi_env/<tag>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from record import interval, pct, points

from turnopd.analysis.frontier import WORK, bootstrap_accuracy, bootstrap_difference, load_run
from turnopd.config import RunConfig, env_views, to_yaml
from turnopd.orchestration.recipe import load_recipe
from turnopd.orchestration.sweep import run_state

RECIPE = "recipes/multi/alfworld_search.yaml"
COMMON = ["eval.teacher=true", "tracking=[]", "checkpoint.every=8"]
RESULTS = Path("benchmarks/results/multi_env")


def arm_recipes(cfg: RunConfig) -> dict[str, RunConfig]:
    """The mixture and each env alone (its view of the recipe, its own teacher only)."""
    alone = {env: dataclasses.replace(view, name=f"{cfg.name}-{env}", teachers={env: cfg.teachers[env]})
             for env, view in env_views(cfg).items()}
    return {"mixture": cfg, **alone}


def run_arm(recipe: RunConfig, seed: int, out: Path) -> Path:
    """One run of an arm (skipped when complete, resumed when interrupted): its recipe written whole to
    out/recipes/, run by `turnopd distill` in a process of its own. Returns its run folder."""
    recipe = dataclasses.replace(recipe, seed=seed, name=f"{recipe.name}-s{seed}", output_dir=str(out / "runs"))
    run_dir = Path(recipe.output_dir) / recipe.name
    state = run_state(run_dir)
    if state == "complete":
        return run_dir
    path = out / "recipes" / f"{recipe.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(recipe))
    resume = ["--resume", str(run_dir)] if state == "incomplete" else []
    subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(path), *resume], check=True)
    return run_dir


def env_result(env: str, mixture: dict[int, Path], alone: dict[int, Path], rng: np.random.Generator) -> dict:
    """One env's comparison: the mixture's runs read as that env's (turnopd frontier --env) against the
    single-env runs, final held-out Avg@k per seed, intervals over tasks and seeds, paired by both; the
    student at the start (step 0's evaluation, the same model in both arms) and the teacher beside them."""
    mine = {seed: load_run(path, env=env) for seed, path in mixture.items()}
    theirs = {seed: load_run(path) for seed, path in alone.items()}
    finals = {seed: run.final for seed, run in mine.items()}
    base = {seed: run.final for seed, run in theirs.items()}
    start = {seed: run.evals[0] for seed, run in theirs.items()}
    teachers = [run.teacher for run in theirs.values() if run.teacher is not None]
    return {"tasks": len(next(iter(finals.values())).per_task),
            "teacher": statistics.fmean(teachers) if teachers else None,
            "start": interval(bootstrap_accuracy(list(start.values()), rng)),
            "mixture": interval(bootstrap_accuracy(list(finals.values()), rng)),
            "alone": interval(bootstrap_accuracy(list(base.values()), rng)),
            "mixture_minus_alone": interval(bootstrap_difference(finals, base, rng)),
            "mixture_minus_start": interval(bootstrap_difference(finals, start, rng)),
            "alone_minus_start": interval(bootstrap_difference(base, start, rng)),
            "per_seed": {seed: {"start": start[seed].avg_at_k, "mixture": finals[seed].avg_at_k,
                                "alone": base[seed].avg_at_k} for seed in finals}}


def work(runs: dict[str, dict[int, Path]], envs: list[str]) -> dict:
    """Per seed, the mixture's work and the single-env runs' together (train records: WORK and the
    training clock), and the median over seeds of their ratio (mixture / alone)."""
    def spent(paths: list[Path]) -> dict[str, float]:
        saved = [load_run(path) for path in paths]
        return {**{key: sum(run.work_by(math.inf)[key] for run in saved) for key in WORK},
                "train_time_s": sum(run.train_time_s for run in saved)}

    per_seed = {seed: {"mixture": spent([path]), "alone": spent([runs[env][seed] for env in envs])}
                for seed, path in runs["mixture"].items()}
    keys = [*WORK, "train_time_s"]
    ratio = {key: statistics.median(s["mixture"][key] / s["alone"][key] for s in per_seed.values())
             for key in keys if all(s["alone"][key] > 0 for s in per_seed.values())}
    return {"per_seed": per_seed, "median_ratio_mixture_over_alone": ratio}


FLOOR = 0.10  # the design's floor rule: a teacher under 10% of its held-out tasks leaves no headroom
MARGIN = 0.15  # the design's margin: the mixture holds the specialist when its difference lies above -15 points


def verdict(r: dict) -> str:
    """The design's words for one env's difference (docs/results/multi-env-design.md)."""
    if r["teacher"] is not None and r["teacher"] < FLOOR:
        return f"no headroom (its teacher wins {100 * r['teacher']:.0f}%): not reported as no interference"
    diff = r["mixture_minus_alone"]
    words = [w for w, holds in ((f"holds the specialist (interval above -{100 * MARGIN:g} points)", diff["lo"] > -MARGIN),
                                ("interference (interval below 0)", diff["hi"] < 0)) if holds]
    return "; ".join(words) or "neither shown at this power"


def page_tables(result: dict) -> str:
    """The results page's tables (docs/results/*-multi-env.md), generated from the saved result."""
    steps, envs = result["steps"], list(result["per_env"])
    rows = [f"| env | tasks | teacher | student at start | mixture after {steps} steps | alone after {steps} steps | "
            "mixture minus alone (paired by task and seed) | by the design |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    changes = ["", "Each arm's change from the start, paired by task and seed:", "",
               "| env | mixture minus start | alone minus start |", "| --- | --- | --- |"]
    for env, r in result["per_env"].items():
        teacher = f"{100 * r['teacher']:.1f}%" if r["teacher"] is not None else "n/a"
        rows.append(f"| {env} | {r['tasks']} | {teacher} | {pct(r['start'])} | {pct(r['mixture'])} | {pct(r['alone'])} | "
                    f"{points(r['mixture_minus_alone'])} | {verdict(r)} |")
        changes.append(f"| {env} | {points(r['mixture_minus_start'])} | {points(r['alone_minus_start'])} |")
    rows += changes
    mean = {arm: statistics.fmean(statistics.fmean(r["per_seed"][seed][arm] for seed in r["per_seed"])
                                  for r in result["per_env"].values()) for arm in ("start", "mixture", "alone")}
    rows += ["", f"Mean over the {len(envs)} envs (each env's mean over seeds): start {100 * mean['start']:.1f}%, "
                 f"mixture {100 * mean['mixture']:.1f}%, alone {100 * mean['alone']:.1f}%.", "",
             "| env | seed | start | mixture | alone |", "| --- | --- | --- | --- | --- |"]
    for env, r in result["per_env"].items():
        for seed, s in r["per_seed"].items():
            rows.append(f"| {env} | {seed} | {100 * s['start']:.1f}% | {100 * s['mixture']:.1f}% | {100 * s['alone']:.1f}% |")
    keys = [*WORK, "train_time_s"]
    rows += ["", "| seed | " + " | ".join(f"{key}: mixture / {' + '.join(envs)}" for key in keys) + " |",
             "| --- | " + " | ".join("---" for _ in keys) + " |"]
    for seed, w in result["work"]["per_seed"].items():
        rows.append(f"| {seed} | " + " | ".join(f"{w['mixture'][key]:,.0f} / {w['alone'][key]:,.0f}" for key in keys) + " |")
    ratio = result["work"]["median_ratio_mixture_over_alone"]
    rows.append("| median ratio | " + " | ".join(f"{ratio[key]:.2f}x" if key in ratio else "n/a" for key in keys) + " |")
    return "\n".join(rows) + "\n"


def plot(result: dict, out: Path) -> None:
    """Each env's held-out success: the student at the start, the mixture and the env alone after
    training (95% intervals over tasks and seeds), the teacher as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["per_env"]), figsize=(4.2 * len(result["per_env"]), 3.4), squeeze=False)
    arms = [("start", "student at start"), ("mixture", "mixture"), ("alone", "env alone")]
    for ax, (env, r) in zip(axes[0], result["per_env"].items(), strict=True):
        for x, (arm, label) in enumerate(arms):
            v = r[arm]
            ax.errorbar([x], [100 * v["value"]], yerr=[[100 * (v["value"] - v["lo"])], [100 * (v["hi"] - v["value"])]],
                        fmt="o", capsize=4, label=label)
        if r["teacher"] is not None:
            ax.axhline(100 * r["teacher"], color="grey", linestyle="--", label="teacher")
        ax.set_xticks(range(len(arms)), [label for _, label in arms])
        ax.set_ylim(-2, 102)
        ax.set_title(f"{env}: {r['tasks']} held-out tasks, {result['seeds']} seeds")
        ax.set_ylabel("held-out success (%)")
    axes[0][-1].legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def smoke_overrides(root: Path) -> list[str]:
    """Tiny random models (the tests' size, seconds to build) on the tiny ALFWorld model's tokenizer, so
    the script's whole path runs in minutes without the three trained models."""
    from turnopd.models.tiny import build_tiny_model

    tokenizer = Path("~/.cache/turnopd/models/tiny-alfworld").expanduser()
    size = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "max_position_embeddings": 1024}
    for name, seed in (("student", 7), ("alfworld_teacher", 0), ("search_teacher", 9)):
        build_tiny_model(root / name, tokenizer=tokenizer, **size, seed=seed)
    for env in ("alfworld", "search"):
        (root / f"{env}.yaml").write_text(f"name: {env}-tiny\nmodel: {root}/{env}_teacher\nbackend: transformers\n"
                                          "dtype: float32\nmax_length: 1024\n")
    return [f"student.path={root}/student", "student.prepare=null", f"teachers.alfworld={root}/alfworld.yaml",
            f"teachers.search={root}/search.yaml", "env.max_turns=3", "envs.search.max_turns=2", "eval.max_tasks=2",
            "trainer.episodes_per_step=4", "policy.max_new_tokens=6", "depth.warmup_steps=1", "depth.probe_every=2",
            "depth.min_successes=1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--smoke", action="store_true", help="tiny random models (checks the script, not the claim)")
    parser.add_argument("--out", type=Path, default=Path("runs/multi_env"), help="run folders and their recipes")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where <tag>.json is written")
    parser.add_argument("--tag", default=None, help="the results file's name (default: full, or smoke)")
    parser.add_argument("--page", action="store_true",
                        help="print the results page's tables from the saved result and draw its figure (<tag>.png)")
    args = parser.parse_args()
    if args.page:
        saved = args.results / f"{args.tag or 'full'}.json"
        result = json.loads(saved.read_text())
        plot(result, saved.with_suffix(".png"))
        print(page_tables(result))
        return
    overrides = [*COMMON, f"trainer.steps={args.steps}"]
    if args.smoke:
        overrides += smoke_overrides(Path(tempfile.mkdtemp(prefix="multi_env_models_")))
    cfg = load_recipe(RECIPE, overrides)
    arms = arm_recipes(cfg)
    runs = {arm: {seed: run_arm(recipe, seed, args.out) for seed in range(args.seeds)} for arm, recipe in arms.items()}
    envs = [arm for arm in arms if arm != "mixture"]
    rng = np.random.default_rng(0)
    result = {"command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat(),
              "recipe": RECIPE, "overrides": overrides, "seeds": args.seeds, "steps": args.steps,
              "episodes_per_step": {"mixture": cfg.trainer.episodes_per_step,
                                    **{env: arms[env].trainer.episodes_per_step for env in envs}},
              "per_env": {env: env_result(env, runs["mixture"], runs[env], rng) for env in envs},
              "work": work(runs, envs)}
    out = args.results / f"{args.tag or ('smoke' if args.smoke else 'full')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["per_env"], indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
