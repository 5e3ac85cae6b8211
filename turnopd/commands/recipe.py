"""`turnopd show RECIPE` and `turnopd distill RECIPE`."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnopd.config import RecipeError, to_yaml
from turnopd.orchestration.recipe import load_recipe

if TYPE_CHECKING:
    from turnopd.core.interrupt import RunStopped


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML (may extend others with `defaults:`)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotlist overrides, e.g. trainer.steps=10 loss.mode=turn")


def show(args: argparse.Namespace) -> int:
    try:
        cfg = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    return 0


def resume_arg(args: argparse.Namespace) -> str | None:
    """--resume, else $TURNOPD_RESUME (a scheduler sets it once for every requeue): only `auto` there."""
    if args.resume:
        return args.resume
    env = os.environ.get("TURNOPD_RESUME", "").strip()
    if env and env != "auto":
        raise RecipeError(f"TURNOPD_RESUME={env!r}: only 'auto' is accepted there (a run folder goes in --resume)")
    return env or None


def distill(args: argparse.Namespace) -> int:
    from turnopd.orchestration.preflight import RunComplete

    try:
        cfg = load_recipe(args.recipe, args.overrides)
        args.resume = resume_arg(args)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _distill(cfg, args)
    except RunComplete as done:
        from turnopd.core.distributed import rank_and_world

        if rank_and_world()[0] == 0:
            print(done, flush=True)
        return 0


def _distill(cfg: Any, args: argparse.Namespace) -> int:
    if args.dry_run:  # checks models by name only: hub students and vllm_server teachers need no download/server
        from teachers.spec import TeacherSpecError
        from turnopd.orchestration.preflight import dry_run

        try:
            dry_run(cfg, resume=args.resume)
        except (RecipeError, TeacherSpecError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    from teachers import TeacherServerError
    from turnopd.core.distributed import rank_and_world
    from turnopd.core.faults import DiskFull
    from turnopd.core.interrupt import RunStopped
    from turnopd.orchestration.distill import EnvFailed, run_distillation
    from turnopd.orchestration.pipeline import GeneratorError
    from turnopd.trainer import TrainingDiverged

    try:
        summary = run_distillation(cfg, resume=args.resume)
    except RecipeError as exc:  # found at start, before heavy work (a resume on another world size, say)
        if rank_and_world()[0] == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except (EnvFailed, GeneratorError, TrainingDiverged, DiskFull, TeacherServerError) as exc:  # the run's own verdict: no traceback needed
        print(f"error: the run stopped: {exc}", file=sys.stderr)
        return 1
    except RunStopped as stopped:
        if rank_and_world()[0] == 0:
            print(stopped_line(stopped, args, rank_and_world()[1]), file=sys.stderr, flush=True)
        return stopped.exit_code
    if rank_and_world()[0] == 0:  # drawn by the run's log at its end (and sent to its trackers)
        print(f"frontier plot (held-out success vs training wall-clock): {Path(summary['run_dir']) / 'frontier.png'}")
    return 0


def stopped_line(stopped: RunStopped, args: argparse.Namespace, world_size: int) -> str:
    """One line for a run a signal stopped: its last step, its checkpoint and how to continue it."""
    command = shlex.join(["turnopd", "distill", args.recipe, *args.overrides])
    if stopped.checkpoint is None:
        return f"{stopped}; no checkpoint to resume from: start it again with `{command}`"
    return (f"{stopped}; checkpoint {stopped.checkpoint}; continue with `{command} --resume {stopped.run_dir}`"
            + (" (under the same torchrun launch)" if world_size > 1 else ""))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print a recipe with its defaults and overrides resolved")
    _add_recipe_args(p)
    p.set_defaults(func=show)

    p = sub.add_parser("distill", help="run on-policy distillation from a recipe")
    _add_recipe_args(p)
    p.add_argument("--resume", metavar="RUN_DIR|auto",
                   help="continue a run from its last checkpoint; `auto` (or $TURNOPD_RESUME=auto): the newest "
                        "incomplete run of the recipe's name if there is one, else a new run; a complete one exits 0")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    p.add_argument("--dry-run", action="store_true",
                   help="validate the recipe, data, models and tokenizers, then stop before training")
    p.set_defaults(func=distill)
