"""A verifiers taskset (verifiers 0.4's verifiers.v1; the `verifiers` extra) of TextArena's single-player
games that need no download, played by verifiers' own TextArenaEnv: the game engine answers each move.
verifiers' bundled `textarena` taskset serves word games whose NLTK data comes from the internet; these
generate their boards offline. Task i is the game reset under seed i (TextArena draws from Python's
process-global RNG, as TextArenaEnv seeds it); its prompt is the engine's first observation.

    env: {name: verifiers, options: {taskset: turnopd_textarena, taskset_args: {game: GuessTheNumber-v0}}}
"""

import itertools
import random
from collections.abc import Iterator
from typing import Literal

import textarena as ta
import verifiers.v1 as vf
from verifiers.v1.tasksets.textarena.taskset import SYSTEM_PROMPT, TextArenaData, TextArenaEnv, TextArenaTask


class OfflineTextArenaConfig(vf.TasksetConfig):
    game: Literal["GuessTheNumber-v0", "TowerOfHanoi-v0", "Minesweeper-v0", "FrozenLake-v0", "Mastermind-v0",
                  "Sudoku-v0", "Crosswords-v0"] = "GuessTheNumber-v0"


def first_observation(game: str, seed: int) -> str:
    random.seed(seed)
    engine = ta.make(env_id=game)
    engine.reset(num_players=1)
    return str(engine.get_observation()[1])


class OfflineTextArenaTaskset(vf.Taskset[TextArenaTask, OfflineTextArenaConfig]):
    INFINITE = True

    def load(self) -> Iterator[TextArenaTask]:
        game = self.config.game
        for seed in itertools.count():
            yield TextArenaTask(TextArenaData(name=f"{game}#{seed}", prompt=first_observation(game, seed),
                                              system_prompt=SYSTEM_PROMPT, info={"game": game, "seed": seed}),
                                self.config.task)


__all__ = ["OfflineTextArenaTaskset", "TextArenaEnv"]
