"""`turnopd world-model train RECIPE`: train a model of an env on logged real transitions and report
its held-out fidelity; `turnopd world-model eval RECIPE`: that fidelity again for the trained model
(see turnopd.orchestration.world_model_training)."""

from __future__ import annotations

import argparse

from turnopd.commands import run_recipe_command


def train(args: argparse.Namespace) -> int:
    from turnopd.orchestration.world_model_training import load_world_model_recipe, run_world_model_train

    return run_recipe_command(args, load_world_model_recipe, run_world_model_train)


def evaluate(args: argparse.Namespace) -> int:
    from turnopd.orchestration.world_model_training import load_world_model_recipe, run_world_model_eval

    return run_recipe_command(args, load_world_model_recipe, run_world_model_eval)


ACTIONS = {  # action: (its function, help, description)
    "train": (train, "train a world model on real transitions; print its held-out fidelity",
              "The env's expert (and a student) play train tasks; a model learns the env's answer to each action; "
              "its greedy answers on held-out episodes are scored against the real env's, and each held-out "
              "episode's actions are replayed in it."),
    "eval": (evaluate, "measure a trained world model's held-out fidelity again (no training)",
             "The recipe's players play its held-out tasks again; the world model in its output_dir answers every "
             "step and replays every episode; world_model.json's tables are rewritten."),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("world-model", help="models of an env that stand in for it in rollouts")
    wm_sub = p.add_subparsers(dest="world_model_command", metavar="ACTION", required=True)
    for action, (func, help_text, description) in ACTIONS.items():
        a = wm_sub.add_parser(action, help=help_text, description=description)
        a.add_argument("recipe", help="world-model recipe YAML (e.g. recipes/alfworld/world_model.yaml)")
        a.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. trainer.steps=50")
        a.add_argument("--dry-run", action="store_true", help="validate and print the recipe, then stop")
        a.set_defaults(func=func)
