"""CLI subcommands (see turnopd/cli.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from turnopd.config import RecipeError


def run_recipe_command(args: argparse.Namespace, load: Callable[[str, list[str]], Any],
                       run: Callable[[Any], Any]) -> int:
    """A command on a recipe: load(args.recipe, args.overrides), then print it (--dry-run) or run it;
    a RecipeError (a bad key, a missing path) is printed as `error: ...` and exits 2."""
    try:
        cfg = load(args.recipe, args.overrides)
        if args.dry_run:
            from turnopd.config import to_yaml

            print(to_yaml(cfg), end="")
            return 0
        run(cfg)
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
