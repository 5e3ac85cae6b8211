"""A verifiers taskset for the adapter's tests: TextArena's GuessTheNumber-v0 (1 to 20, 10 guesses),
played by verifiers' own TextArenaEnv, the TextArena engine answering each move. verifiers' bundled
textarena taskset serves word games that download NLTK data; this one generates its boards offline,
as it does (the task's prompt is the seeded engine's first observation)."""

import random

import textarena as ta
import verifiers.v1 as vf
from verifiers.v1.tasksets.textarena.taskset import SYSTEM_PROMPT, TextArenaData, TextArenaEnv, TextArenaTask

GAME = "GuessTheNumber-v0"


def target(seed: int) -> int:
    """The number the engine hides for a seed (TextArena draws it at reset)."""
    random.seed(seed)
    game = ta.make(env_id=GAME)
    game.reset(num_players=1)
    return game.game_number


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 8


class GuessTaskset(vf.Taskset[TextArenaTask, GuessConfig]):
    def load(self):
        for seed in range(self.config.num_tasks):
            random.seed(seed)
            game = ta.make(env_id=GAME)
            game.reset(num_players=1)
            yield TextArenaTask(TextArenaData(name=f"{GAME}#{seed}", prompt=str(game.get_observation()[1]),
                                              system_prompt=SYSTEM_PROMPT, info={"game": GAME, "seed": seed}),
                                self.config.task)


__all__ = ["GuessTaskset", "TextArenaEnv"]
