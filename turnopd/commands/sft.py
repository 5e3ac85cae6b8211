"""`turnopd sft RECIPE`: fine-tune a teacher on an env's expert demonstrations (see turnopd.orchestration.sft)."""

from __future__ import annotations

import argparse
import sys

from turnopd.config import RecipeError


def sft(args: argparse.Namespace) -> int:
    from turnopd.orchestration.sft import load_sft_recipe, run_sft

    try:
        cfg = load_sft_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        from turnopd.config import to_yaml

        print(to_yaml(cfg), end="")
        return 0
    try:
        run_sft(cfg, recipe=args.recipe)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="fine-tune a teacher on an env's expert demonstrations "
                                                "(and relabelled student states)")
    p.add_argument("recipe", help="SFT recipe YAML (e.g. recipes/alfworld/teacher_sft.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. trainer.steps=50")
    p.add_argument("--dry-run", action="store_true", help="validate and print the recipe, then stop")
    p.set_defaults(func=sft)
