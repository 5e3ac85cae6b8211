"""`turnopd sft RECIPE`: fine-tune a teacher on an env's expert demonstrations (see turnopd.orchestration.sft)."""

from __future__ import annotations

import argparse

from turnopd.commands import run_recipe_command


def sft(args: argparse.Namespace) -> int:
    from turnopd.orchestration.sft import load_sft_recipe, run_sft

    return run_recipe_command(args, load_sft_recipe, lambda cfg: run_sft(cfg, recipe=args.recipe))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="fine-tune a teacher on an env's expert demonstrations "
                                                "(and relabelled student states)")
    p.add_argument("recipe", help="SFT recipe YAML (e.g. recipes/alfworld/teacher_sft.yaml)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. trainer.steps=50")
    p.add_argument("--dry-run", action="store_true", help="validate and print the recipe, then stop")
    p.set_defaults(func=sft)
