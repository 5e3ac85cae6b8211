"""One ALFWorld episode at a time on the real TextWorld engine (runs inside an env-pool worker).

Games are json_2.1.1 `game.tw-pddl` files, loaded as ALFWorld's own batch loader does:
`textworld.start` with alfworld's AlfredDemangler + AlfredInfos wrappers. alfworld and textworld are
imported here, lazily, so that importing `envs.alfworld` stays light.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import pickle
import zlib
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from envs.alfworld.notes import Notebook
from envs.base import StepOutcome
from envs.cache import cache_root, content_key

# alfworld creates $ALFWORLD_DATA (default ~/.cache/alfworld) on import; keep it in the project's cache.
ALFWORLD_CACHE = Path.home() / ".cache" / "turnopd" / "alfworld"
GAME_FILE = "game.tw-pddl"
TASK_PREFIX = "Your task is to: "


def task_params(task_id: str) -> dict[str, Any]:
    """ALFRED's pddl_params from the task folder name `<type>-<object>-<movable recep>-<recep>-<scene>`
    (the 4th field is the light to toggle in look_at_obj_in_light), as alfworld's expert reads them
    from traj_data.json, which json_2.1.1 game folders do not carry."""
    import_alfworld()
    import alfworld.gen.constants as constants

    task_type, obj, mrecep, recep, _scene = task_id.split("/")[0].split("-")
    sliced = obj.endswith("Sliced")
    params = {
        "task_type": task_type,
        "object_target": obj.removesuffix("Sliced"),
        "object_sliced": sliced,
        "mrecep_target": "" if mrecep == "None" else mrecep,
        "parent_target": "" if task_type == "look_at_obj_in_light" else recep,
        "toggle_target": recep if task_type == "look_at_obj_in_light" else "",
    }
    # alfworld lower-cases the names that are ALFRED object classes (HandCodedAgent.reset)
    return {k: v.lower() if v in constants.OBJECTS else v for k, v in params.items()}


class GameLoadError(RuntimeError):
    """A game file that TextWorld cannot load (missing, corrupted or not an ALFWorld game)."""


def import_alfworld() -> None:
    """Point alfworld at the project cache (unless the user chose a folder), then import it."""
    os.environ.setdefault("ALFWORLD_DATA", str(ALFWORLD_CACHE))
    import alfworld.agents.environment.alfred_tw_env  # noqa: F401

    _cache_game_loading()
    _speed_up_text_generation()


def _cache_game_loading() -> None:
    """Loading a game costs TextWorld ~1.3 s: it translates the game's PDDL to SAS four times
    (twice on load, twice again on reset; ~0.6 s each) and parses the game's logic and grammar with
    tatsu (~0.1 s). Both are pure functions of their text. Cache them on disk for every worker and
    later run (the translation also in this worker's memory; the parsed logic is unpickled fresh per
    load, since TextWorld writes into its grammar): a game is then translated and parsed once per
    machine, and loads in ~0.1 s. The cached translation is only read by TextWorld's PddlState."""
    import fast_downward
    from textworld.envs.pddl import logic

    if hasattr(fast_downward.pddl2sas, "cache_info"):
        return
    fast_downward.pddl2sas = functools.lru_cache(maxsize=256)(_cached_on_disk(fast_downward.pddl2sas, "pddl2sas"))
    logic._parse_and_convert = _cached_on_disk(logic._parse_and_convert, "game-logic")


def _cached_on_disk(function: Callable, name: str) -> Callable:
    """`function`, a pure function of its (repr-able) arguments, with each result kept as a
    zlib-compressed pickle (tens of kB) under the project cache, in a folder per installed engine."""
    engine = "-".join(f"{dist}-{version(dist)}" for dist in ("textworld", "fast_downward_textworld"))
    folder = cache_root() / "alfworld-games" / engine / name

    @functools.wraps(function)
    def cached(*args, **kwargs):
        path = folder / f"{content_key(repr(args), repr(sorted(kwargs.items())))}.pkl.z"
        try:
            return pickle.loads(zlib.decompress(path.read_bytes()))
        except (OSError, zlib.error, pickle.UnpicklingError, EOFError):
            pass  # not cached yet, or unreadable: compute it (again)
        result = function(*args, **kwargs)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            scratch.write_bytes(zlib.compress(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL), level=1))
            os.replace(scratch, path)  # atomic: a reader sees the whole file or none
        except OSError:  # a read-only or full cache only costs speed
            with contextlib.suppress(OSError):
                scratch.unlink()
        return result

    return cached


def _speed_up_text_generation() -> None:
    """TextWorld writes every step's feedback and admissible commands with its PDDL text grammar, and
    spends ~90% of a step doing so: it re-parses the same grammar strings with tatsu and deep-copies
    every entity record of each context it derives in. Both parsers are pure functions of their
    string: memoize them (a parsed derivation is handed out as a copy, since the generator writes
    contexts into its symbols). And copy a context's `variables` and `mapping` one level deep: their
    values are entity records and PDDL variables that the grammar only reads (`o.name`,
    `r.indefinite`). The text is the same character for character (tests/envs/test_alfworld.py) and
    a step 16-17x faster (benchmarks/alfworld_engine.py). The originals stay as `__wrapped__`."""
    from textworld.envs.pddl import textgen
    from textworld.logic import Rule

    if hasattr(textgen.copy_context, "__wrapped__"):
        return
    parse_symbols = functools.lru_cache(maxsize=4096)(textgen._parse_and_convert)

    @functools.wraps(textgen._parse_and_convert)
    def parse_and_convert(*args, **kwargs):
        return copy.deepcopy(parse_symbols(*args, **kwargs))

    @functools.wraps(textgen.copy_context)
    def copy_context(context):
        return {"state": context["state"], "facts": context["facts"], "variables": dict(context["variables"]),
                "mapping": dict(context["mapping"]), "entity_infos": context["entity_infos"]}

    textgen._parse_and_convert = parse_and_convert
    textgen.copy_context = copy_context
    Rule.parse_conjunctive_query = classmethod(functools.lru_cache(maxsize=4096)(Rule.parse_conjunctive_query.__func__))


def goal_of(observation: str) -> str:
    """The goal sentence of ALFWorld's first observation ('Your task is to: put a pen in drawer.')."""
    start = observation.find(TASK_PREFIX)
    if start < 0:
        raise GameLoadError(f"no '{TASK_PREFIX.strip()}' line in the first observation: {observation[:200]!r}")
    return observation[start + len(TASK_PREFIX):].strip()


class AlfworldEnv:
    """The Env of one worker slot. `game_dirs` are the split folders a task id may live in (task ids
    are unique across splits). With `facts`, each outcome carries the engine's facts in
    info["facts"] as (predicate, argument names) pairs: alfworld's handcoded expert reads them."""

    def __init__(self, game_dirs: list[Path], facts: bool = False, notes: bool = False):
        self.game_dirs = game_dirs
        self.facts = facts
        self.notes = notes  # append the notebook line (envs.alfworld.notes) to each observation
        self._env: Any = None
        self._admissible: list[str] = []
        self._notebook: Notebook | None = None

    def game_file(self, task_id: str) -> Path:
        for folder in self.game_dirs:
            path = folder / task_id / GAME_FILE
            if path.is_file():
                return path
        raise GameLoadError(f"no ALFWorld game {task_id!r}: looked for {GAME_FILE} under "
                            + ", ".join(str(folder) for folder in self.game_dirs))

    def reset(self, task_id: str) -> StepOutcome:
        import_alfworld()
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        path = self.game_file(task_id)
        self.close()
        infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=self.facts, extras=["gamefile"])
        try:
            self._env = textworld.start(str(path), request_infos=infos,
                                        wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
            state = self._env.reset()
        except Exception as exc:  # json, PDDL or grammar errors all mean the same: the game is broken
            self._env = None
            raise GameLoadError(f"cannot load ALFWorld game {path}: {type(exc).__name__}: {exc}") from exc
        outcome = self._outcome(state, reward=0.0, done=False)
        outcome.info["task"] = goal_of(outcome.observation)
        if self.notes:
            self._notebook = Notebook.for_task(task_params(task_id), outcome.observation)
            outcome.observation += "\n" + self._notebook.line(outcome.admissible)
        return outcome

    def step(self, action: str) -> StepOutcome:
        if self._env is None:
            raise RuntimeError("step() before reset()")
        # ALFWorld answers "Nothing happens." to any command it does not admit; flag those.
        invalid = action not in self._admissible
        state, score, done = self._env.step(action)
        outcome = self._outcome(state, reward=float(score), done=bool(done))
        outcome.info["invalid"] = invalid
        if self._notebook is not None:
            self._notebook.update(action, outcome.observation)
            outcome.observation += "\n" + self._notebook.line(outcome.admissible)
        return outcome

    def _outcome(self, state: Any, reward: float, done: bool) -> StepOutcome:
        self._admissible = list(state["admissible_commands"])
        info: dict[str, Any] = {}
        if self.facts:
            info["facts"] = [(fact.name, [arg.name for arg in fact.arguments]) for fact in state["facts"]]
        return StepOutcome(observation=state.feedback, reward=reward, done=done, won=bool(state["won"]),
                           admissible=list(self._admissible), info=info)

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
