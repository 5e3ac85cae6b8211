"""`turnopd` command line: one subcommand per module in turnopd/commands (each has `register`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Each module defines register(subparsers) which adds its parser and sets `func(args) -> int`.
COMMAND_MODULES = [
    "turnopd.commands.recipe",  # distill, show
    "turnopd.commands.data",  # data status, data fetch
    "turnopd.commands.env",  # env list | play | expert
    "turnopd.commands.frontier",  # frontier, sweep
    "turnopd.commands.teacher",  # teacher serve
    "turnopd.commands.model",  # model prepare
    "turnopd.commands.sft",  # sft
    "turnopd.commands.world_model",  # world-model train
    "turnopd.commands.judge",  # judge bench | judge play
    "turnopd.commands.new",  # new env | new teacher
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnopd",
        description="Turn-aware on-policy distillation of long-horizon LLM agents.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Our own progress bars say what is happening; silence the per-file ones of model loading.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse leaves KEY=VALUE overrides that follow an option (`sweep R --seeds 3 a=1`) unparsed
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
            "=" in a and not a.startswith("-") for a in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
