"""ALFWorld env steps/s and resets with TextWorld as it is and with the speed-ups TurnOPD installs
(envs/alfworld/game.py: memoized grammar parsers and contexts copied one level deep for steps;
game loading cached on disk for resets), side by side in one run on the same games and actions, and
whether they wrote the same text.

    python benchmarks/alfworld_engine.py                    # 8 held-out games, 40 random turns each
    python benchmarks/alfworld_engine.py --games 18 --turns 40 --task-types look_at_obj_in_light

Three sides, each in a fresh process (TextWorld keeps derived texts in its cached game logic, so a
second pass in one process would be faster on any side), in-process env, seeded random admissible
actions (a weak student's long episodes): TextWorld's own; TurnOPD's with an empty game cache (a
game's first load on this machine: the cold side fills the cache); TurnOPD's again (every later load).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from record import MIN_REPEATS, Summary, save_result
from rich.console import Console

SIDES = {"original": "TextWorld's own", "cold": "TurnOPD's, first load of each game",
         "warm": "TurnOPD's, game loading cached"}


def play_side(side: str, task_types: list[str] | None, games: int, turns: int, data_dir: str | None) -> dict:
    """Play the games on one side in this process: seconds in env.step and env.reset, steps, text digest."""
    import envs.alfworld.game as game

    if side == "original":
        game._cache_game_loading = game._speed_up_text_generation = lambda: None
    from envs import make_env_spec
    from turnopd.config import EnvConfig

    config = EnvConfig(name="alfworld", options={"notes": True}, **({"task_types": task_types} if task_types else {}))
    spec = make_env_spec(config, data_dir)
    held_out = spec.tasks("valid_unseen")
    task_ids = held_out[:: max(1, len(held_out) // games)][:games]  # spread over task types and scenes
    env = spec.make()
    rng = random.Random(0)
    texts, step_s, reset_s, steps = [], 0.0, 0.0, 0
    for task_id in task_ids:
        start = time.perf_counter()
        outcome = env.reset(task_id)
        reset_s += time.perf_counter() - start
        texts.append([outcome.observation, outcome.admissible])
        for _ in range(turns):
            action = rng.choice(outcome.admissible)
            start = time.perf_counter()
            outcome = env.step(action)
            step_s += time.perf_counter() - start
            steps += 1
            texts.append([outcome.observation, outcome.admissible])
            if outcome.done:
                break
    env.close()
    digest = hashlib.sha256(json.dumps(texts).encode()).hexdigest()
    return {"games": len(task_ids), "steps": steps, "step_s": step_s, "reset_s": reset_s, "digest": digest}


def play_sides(args: argparse.Namespace, console: Console) -> dict[str, dict]:
    """One repeat: every side in its own process, the cold side on an empty game cache."""
    measured = {}
    with tempfile.TemporaryDirectory() as cache:  # an empty game cache for the cold side, kept for the warm one
        for side in SIDES:
            with console.status(f"playing {args.games} games: {SIDES[side]}"):
                child = [sys.executable, __file__, "--side", side, "--games", str(args.games), "--turns", str(args.turns)]
                child += ["--task-types", *args.task_types] if args.task_types else []
                child += ["--data-dir", args.data_dir] if args.data_dir else []
                out = subprocess.run(child, check=True, capture_output=True, text=True,
                                     env={**os.environ, "TURNOPD_CACHE": cache}).stdout
                measured[side] = json.loads(out.strip().splitlines()[-1])
    return measured


def summaries(repeats: list[dict[str, dict]]) -> list[Summary]:
    original = [r["original"] for r in repeats]
    out = [Summary.of(f"{SIDES['original']}: env steps/s", [m["steps"] / m["step_s"] for m in original], "steps/s")]
    for side in ("cold", "warm"):
        mine = [r[side] for r in repeats]
        out.append(Summary.of(f"{SIDES[side]}: env steps/s", [m["steps"] / m["step_s"] for m in mine], "steps/s"))
        out.append(Summary.of(f"{SIDES[side]}: step speed-up", [o["step_s"] / m["step_s"] for o, m in zip(original, mine, strict=True)],
                              "x"))
        out.append(Summary.of(f"{SIDES[side]}: reset speed-up",
                              [o["reset_s"] / m["reset_s"] for o, m in zip(original, mine, strict=True)], "x"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=8, help="held-out games (valid_unseen)")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--task-types", nargs="*", default=None, help="default: all six")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in a child process
    args = parser.parse_args()
    if args.side:
        print(json.dumps(play_side(args.side, args.task_types, args.games, args.turns, args.data_dir)))
        return
    console = Console()
    repeats = [play_sides(args, console) for _ in range(args.repeats)]
    differ = [side for r in repeats for side in SIDES if r[side]["digest"] != r["original"]["digest"]]
    if differ:
        raise SystemExit(f"the sides wrote different text: {sorted(set(differ))}")
    first = repeats[0]["original"]
    save_result("alfworld_engine", f"ALFWorld engine, TextWorld's own vs TurnOPD's speed-ups ({first['games']} "
                f"held-out games, {first['steps']} random steps, the same text on every side)", summaries(repeats),
                repeats)


if __name__ == "__main__":
    main()
