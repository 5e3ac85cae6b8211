"""One TextWorldExpress game at a time on the real engine (the Scala engine of the `textworld-express`
package, driven through py4j). It runs inside an env-pool worker.

The engine is a JVM: one per process, started on the first reset (~0.6 s with its first game), in
which each env (one per pool slot) gets its own game interface; the package's own
`TextWorldExpressEnv` would start one JVM per env. The JVM exits with its process (py4j's
die_on_exit: it stops when its stdin closes), also when the pool kills a hung worker.
"""

from __future__ import annotations

import json
from typing import Any

from envs.base import StepOutcome

# JIT to C1 only and the serial collector, measured here against the JVM's defaults (and the
# package's -Xverify:none): first game 0.4-0.6 s instead of ~1 s, ~2 ms instead of ~2.7 ms per reset
# or step (py4j round trips included), 160 MB instead of 310 MB resident per JVM.
JAVA_OPTIONS = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]

FOLDS = ("train", "dev", "test")  # the engine's folds
_engine: Any = None  # this process's py4j gateway to the JVM


def engine() -> Any:
    """This process's JVM (a py4j JavaGateway), started on first use and again if it died."""
    global _engine
    if _engine is None or _engine.java_process.poll() is not None:
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
        from textworld_express.constants import BASEPATH, JAR_PATH

        # cwd: the engine reads its object lists (e.g. twc_objects.folds.json) from the working directory
        port, process = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH,
                                       javaopts=JAVA_OPTIONS, return_proc=True)
        # No py4j finalizers (memory management): they would talk to the JVM from inside Python's
        # garbage collector, and log errors there once it died (on Python 3.11.7 a traceback formatted
        # there breaks a later ast.parse). The env detaches what it keeps instead.
        _engine = JavaGateway(gateway_parameters=GatewayParameters(port=port, auto_field=True,
                                                                   enable_memory_management=False),
                              java_process=process)
    return _engine


def parse_task_id(task_id: str) -> tuple[str, str, int]:
    """'coin/test/20000' -> ('coin', 'test', 20000): game, fold and seed."""
    parts = task_id.split("/")
    if len(parts) != 3 or parts[1] not in FOLDS or not parts[2].isdigit():
        raise ValueError(f"TextWorldExpress task id {task_id!r}: expected GAME/FOLD/SEED with FOLD one of "
                         f"{', '.join(FOLDS)}, e.g. coin/test/20000")
    return parts[0], parts[1], int(parts[2])


class TwxEnv:
    """The Env of one pool slot. `game_params`: each game's parameter string (the engine's
    gameParams, e.g. "numLocations=5,includeDoors=1"). Outcomes carry the engine's valid actions
    (sorted: the engine lists them in hash order), its score delta as reward, and at reset the task
    description in info["task"] and the engine's gold path in info["gold_path"] (the expert's plan)."""

    def __init__(self, game_params: dict[str, str]):
        self.game_params = game_params
        self._gateway: Any = None  # the JVM that holds self._game
        self._game: Any = None  # the engine's game interface (textworldexpress.runtime.PythonInterface)
        self._loaded: str | None = None  # the game whose generator is loaded in it
        self._admissible: list[str] = []
        self._score = 0.0

    def reset(self, task_id: str) -> StepOutcome:
        game, fold, seed = parse_task_id(task_id)
        if game not in self.game_params:
            raise ValueError(f"TextWorldExpress task {task_id!r}: unknown game {game!r}; "
                             f"known: {', '.join(self.game_params)}")
        if self._gateway is not engine():  # first reset, or the JVM died and was started again
            self._gateway = engine()
            self._game = self._gateway.jvm.textworldexpress.runtime.PythonInterface()
            self._loaded = None
        if self._loaded != game:
            error = self._game.load(game, self.game_params[game])
            if error:
                raise ValueError(f"TextWorldExpress refused game {game!r} with parameters "
                                 f"{self.game_params[game]!r}: {error.strip()}")
            self._loaded = game
        state = json.loads(self._game.generateNewGameJSON(seed, fold, True))
        self._score = 0.0
        outcome = self._outcome(state, reward=0.0)
        outcome.info["task"] = self._game.getTaskDescription().strip()
        gold_path = self._game.getGoldActionSequence()  # a java.util.List
        outcome.info["gold_path"] = list(gold_path)
        self._gateway.detach(gold_path)
        return outcome

    def step(self, action: str) -> StepOutcome:
        if self._loaded is None:
            raise RuntimeError("step() before reset()")
        process = self._gateway.java_process
        if process.poll() is not None:
            raise RuntimeError(f"the TextWorldExpress engine (JVM pid {process.pid}) exited with code "
                               f"{process.returncode}; the next reset starts another")
        invalid = action not in self._admissible
        # py4j sends UTF-8, which cannot carry a lone surrogate (broken unicode from a tokenizer); the
        # engine answers any unknown text, whatever its length, as an unknown action
        sendable = action.encode("utf-8", "replace").decode("utf-8")
        state = json.loads(self._game.stepJSON(sendable))
        score = float(state["score"])
        outcome = self._outcome(state, reward=score - self._score)
        self._score = score
        outcome.info["invalid"] = invalid
        return outcome

    def _outcome(self, state: dict[str, Any], reward: float) -> StepOutcome:
        self._admissible = sorted(state["validActions"])
        # done as the package's TextWorldExpressEnv.step says (without its step limit: the rollout
        # caps episodes); won is the engine's task success
        done = bool(state["tasksuccess"] or state["taskfailure"] or state["score"] >= 1.0)
        return StepOutcome(observation=state["observation"].strip(), reward=reward, done=done,
                           won=bool(state["tasksuccess"]), admissible=list(self._admissible))

    def close(self) -> None:
        if self._game is not None and self._gateway.java_process.poll() is None:
            self._gateway.detach(self._game)  # the JVM lives on for the worker's other envs
        self._gateway = self._game = self._loaded = None
