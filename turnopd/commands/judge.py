"""`turnopd judge bench RECIPE`: a judge's selective accuracy and coverage on pairs of changes whose
outcomes the env gives, by changes kept and memory mode (the confidence-cliff table); `turnopd judge
play RECIPE`: the recipe's student with and without the judge on held-out tasks; `turnopd judge report
FILE`: a saved report's tables again, as Markdown (see turnopd.orchestration.judge_bench)."""

from __future__ import annotations

import argparse
import functools

from turnopd.commands import run_recipe_command


def _load(recipe: str, overrides: list[str]):
    from turnopd.orchestration.recipe import load_recipe

    return load_recipe(recipe, overrides)


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def bench(args: argparse.Namespace) -> int:
    from turnopd.algorithm.judge import JUDGES, MEMORY_MODES
    from turnopd.config import RecipeError
    from turnopd.orchestration.judge_bench import run_judge_bench

    bys, memories = _names(args.by), _names(args.memory)
    bad = [b for b in bys if b not in JUDGES] + [m for m in memories if m not in MEMORY_MODES]
    if bad or not bys or not memories:
        raise SystemExit(f"error: --by takes {','.join(JUDGES)} and --memory {','.join(MEMORY_MODES)}; got {bad}")
    try:
        return run_recipe_command(args, _load, functools.partial(
            run_judge_bench, split=args.split, max_tasks=args.max_tasks, walks=args.walks, max_depth=args.max_depth,
            pairs_per_state=args.pairs_per_state, bys=bys, memories=memories, world_model=args.world_model,
            output=args.output))
    except RecipeError as exc:  # raised after the recipe loaded (an env without a metric, no world model)
        raise SystemExit(f"error: {exc}") from None


def play(args: argparse.Namespace) -> int:
    from turnopd.config import RecipeError
    from turnopd.orchestration.judge_bench import run_judge_play

    try:
        return run_recipe_command(args, _load, functools.partial(
            run_judge_play, split=args.split, max_tasks=args.max_tasks, seeds=args.seeds, arms=_names(args.arms),
            output=args.output))
    except RecipeError as exc:
        raise SystemExit(f"error: {exc}") from None


def report(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from turnopd.orchestration.judge_bench import bench_markdown, play_markdown

    for path in args.reports:
        try:
            saved = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"error: {path}: {exc}") from None
        if "pairs" in saved and "arms" in saved:
            print(bench_markdown(saved))
        elif "episodes" in saved and "clock" in saved:
            print(play_markdown(saved))
        else:
            raise SystemExit(f"error: {path} is neither a `judge bench` nor a `judge play` report")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("judge", help="judge changes before running them: the pairwise benchmark, the judged agent")
    judge_sub = p.add_subparsers(dest="judge_command", metavar="ACTION", required=True)
    b = judge_sub.add_parser("bench", help="selective accuracy and coverage of each judge and memory mode, by depth",
                             description="Walks on the split's tasks run every single change at each state (the "
                                         "env's memo: an exact oracle); pairs of a change that helped and one that "
                                         "did not are judged in both orders (strict consensus), with the walk's "
                                         "earlier attempts as memory.")
    b.add_argument("--by", default="teacher,teacher_policy",
                   help="judges, comma-separated: teacher, teacher_policy, world_model (default teacher,teacher_policy)")
    b.add_argument("--memory", default="none,focused,full,summary", help="memory modes, comma-separated")
    b.add_argument("--walks", type=int, default=2, help="seeded walks per task (default 2)")
    b.add_argument("--max-depth", type=int, default=4, help="changes kept before a walk stops (default 4)")
    b.add_argument("--pairs-per-state", type=int, default=12, help="pairs drawn at each state (default 12)")
    b.add_argument("--world-model", default=None, help="world-model folder (default: the recipe's world_model.path)")
    b.set_defaults(func=bench)
    pl = judge_sub.add_parser("play", help="the student with and without the judge on held-out tasks, paired seeds",
                              description="Every arm plays each task once per seed with the same sampling seeds; "
                                          "the judge's k and temperature are the recipe's judge block.")
    pl.add_argument("--arms", default="none,judge,focused",
                    help="comma-separated: none, judge (teacher, no memory), focused, full, summary, policy "
                         "(teacher_policy)")
    pl.add_argument("--seeds", type=int, default=3, help="seeds per arm (default 3)")
    pl.set_defaults(func=play)
    r = judge_sub.add_parser("report", help="a saved bench or play report's tables again, as Markdown")
    r.add_argument("reports", nargs="+", metavar="FILE", help="JSON reports written by judge bench or judge play")
    r.set_defaults(func=report)
    for a in (b, pl):
        a.add_argument("recipe", help="distillation recipe YAML (e.g. recipes/autoresearch.yaml)")
        a.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. judge.k=4")
        a.add_argument("--split", default="test", help="the env split (default test)")
        a.add_argument("--max-tasks", type=int, default=None, help="the split's first N tasks (default all)")
        a.add_argument("-o", "--output", default=None, help="JSON report (default OUTPUT_DIR/judge_bench|judge_play/...)")
        a.add_argument("--dry-run", action="store_true", help="validate and print the recipe, then stop")
