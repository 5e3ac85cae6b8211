"""`turnopd world-model train RECIPE`: train a model of an env on logged real transitions and report
its held-out fidelity (see turnopd.orchestration.world_model)."""

from __future__ import annotations

import argparse

from turnopd.commands import run_recipe_command


def train(args: argparse.Namespace) -> int:
    from turnopd.orchestration.world_model import load_world_model_recipe, run_world_model_train

    return run_recipe_command(args, load_world_model_recipe, run_world_model_train)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("world-model", help="models of an env that stand in for it in rollouts")
    wm_sub = p.add_subparsers(dest="world_model_command", metavar="ACTION", required=True)
    t = wm_sub.add_parser("train", help="train a world model on real transitions; print its held-out fidelity",
                          description="The env's expert (and a student) play train tasks; a model learns the env's "
                                      "answer to each action; its greedy answers on held-out episodes are scored "
                                      "against the real env's.")
    t.add_argument("recipe", help="world-model recipe YAML (e.g. recipes/alfworld/world_model.yaml)")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. trainer.steps=50")
    t.add_argument("--dry-run", action="store_true", help="validate and print the recipe, then stop")
    t.set_defaults(func=train)
