"""The TextWorldExpress EnvSpec: splits and task ids, game parameters, action parsing and the expert.

Scaffolded by `turnopd new env twx`, then filled in (docs/adding-an-env.md tells how).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envs.base import (
    Expert,
    ParsedAction,
    PromptContext,
    check_known,
    check_split,
    extract_action,
    select_tasks,
    select_template,
)
from envs.twx.env import FOLDS, TwxEnv, parse_task_id
from envs.twx.expert import GoldPathExpert
from envs.twx.prompt import TEMPLATES

SPLITS = FOLDS  # TextWorldExpress's folds: train, dev, test
# The seeds of each fold: the same for every game (the engine's getValidSeeds{Train,Dev,Test}). A fold
# also picks its own objects (e.g. twc's household items), so a seed means another game in another fold.
FOLD_SEEDS = {"train": range(0, 1000), "dev": range(10000, 11000), "test": range(20000, 21000)}

# The games (the task types) and the parameters each game's generator knows (as the engine lists them).
GAME_PARAMETERS: dict[str, tuple[str, ...]] = {
    "coin": ("numLocations", "numDistractorItems", "includeDoors", "limitInventorySize"),
    "cookingworld": ("numLocations", "numIngredients", "numDistractorItems", "includeDoors", "limitInventorySize"),
    "twc": ("numLocations", "numItemsToPutAway", "includeDoors", "limitInventorySize"),
    "mapreader": ("numLocations", "maxDistanceApart", "maxDistractorItemsPerLocation", "includeDoors",
                  "limitInventorySize"),
    "arithmetic": (),
    "sorting": (),
    "simonsays": ("gameLength", "numDistractors", "memorization", "verbose"),
    "peckingorder": (),
}
GAMES = tuple(GAME_PARAMETERS)

# The engine's defaults ("") except cookingworld, whose default (11 rooms, 3 ingredients, 10
# distractors, doors) has gold paths of up to 90 steps. Measured over the 1,000 seeds of each fold:
# cookingworld's paths below take at most 47 steps (39 on dev and test), the other games' at most
# ~37 (coin's and twc's are random walks, see expert.py), all under default_max_turns.
DEFAULT_GAME_PARAMS = {game: "" for game in GAMES} | {
    "cookingworld": "numLocations=5,numIngredients=2,numDistractorItems=5,includeDoors=0,limitInventorySize=0",
}
OPTIONS: dict[str, Any] = {"game_params": {}}  # option -> default


def check_game_params(game: str, params: str) -> None:
    """A game's parameter string: comma-separated NAME=INTEGER with names the game knows. The engine
    checks the values' ranges when it loads the game."""
    for item in filter(None, params.split(",")):
        name, _, value = item.partition("=")
        if name not in GAME_PARAMETERS[game]:
            known = ", ".join(GAME_PARAMETERS[game]) or "none"
            raise ValueError(f"twx option game_params.{game}: unknown parameter {name!r}; known: {known}")
        if not value.strip().isdigit():
            raise ValueError(f"twx option game_params.{game}: {item!r} is not NAME=INTEGER")


class TwxSpec:
    """TextWorldExpress games (coin, cookingworld, twc, mapreader, arithmetic, sorting, simonsays,
    peckingorder) on the real engine. Task ids are GAME/FOLD/SEED ('coin/test/20000'); a split lists
    its 1,000 seeds, each with every selected game in the order of GAMES (seed-major, so the first N
    tasks cover every game). Task types are the games.

    Option `game_params`: {game: parameter string} replacing that game's DEFAULT_GAME_PARAMS, e.g.
    {cookingworld: "numLocations=1,numIngredients=1,numDistractorItems=0,includeDoors=0"}.
    """

    name = "twx"
    default_max_turns = 50
    observation_version = "1"

    def __init__(self, config: Any, data_dir: str | None = None):
        # data_dir is not used: the engine generates its games from seeds
        self.config = config
        self.render_template = select_template(TEMPLATES, config.template, self.name)
        check_known("TextWorldExpress task types", config.task_types, GAMES, key="task_types")
        check_known("twx options", config.options, OPTIONS, key="options")
        given = config.options.get("game_params", OPTIONS["game_params"])
        if not isinstance(given, Mapping):
            raise ValueError(f"twx option game_params must map games to parameter strings; got {given!r}")
        check_known("twx game_params games", given, GAMES)
        self.game_params = {**DEFAULT_GAME_PARAMS, **{game: str(p) for game, p in given.items()}}
        for game, params in self.game_params.items():
            check_game_params(game, params)

    def splits(self) -> list[str]:
        return list(SPLITS)

    def tasks(self, split: str) -> list[str]:
        check_split("TextWorldExpress", split, SPLITS)
        ids = (f"{game}/{split}/{seed}" for seed in FOLD_SEEDS[split] for game in GAMES)
        return select_tasks(ids, self.task_type, self.config)

    def task_type(self, task_id: str) -> str:
        return parse_task_id(task_id)[0]

    def make(self) -> TwxEnv:
        """An env for one pool slot; called inside a worker process."""
        return TwxEnv(self.game_params)

    def expert(self, task_id: str) -> Expert:
        return GoldPathExpert(task_id)

    def parse_action(self, text: str) -> ParsedAction:
        """The action in the answer, spaces collapsed and case kept (the engine's commands are case
        sensitive: 'take TV remote control'); whether the engine knows it is the env's call."""
        return extract_action(text)

    def render_prompt(self, ctx: PromptContext) -> str:
        return self.render_template(ctx)
