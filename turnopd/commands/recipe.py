"""`turnopd show RECIPE` and `turnopd distill RECIPE`."""

from __future__ import annotations

import argparse
import sys

from turnopd.config import RecipeError, load_recipe, to_yaml


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


def distill(args: argparse.Namespace) -> int:
    try:
        cfg = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from turnopd.distill import run_distillation

    run_distillation(cfg, resume=args.resume, dry_run=args.dry_run)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print a recipe with its defaults and overrides resolved")
    _add_recipe_args(p)
    p.set_defaults(func=show)

    p = sub.add_parser("distill", help="run on-policy distillation from a recipe")
    _add_recipe_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    p.add_argument("--dry-run", action="store_true",
                   help="validate the recipe, data, models and tokenizers, then stop before training")
    p.set_defaults(func=distill)
