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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=8, help="held-out games (valid_unseen)")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--task-types", nargs="*", default=None, help="default: all six")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in a child process
    args = parser.parse_args()
    if args.side:
        print(json.dumps(play_side(args.side, args.task_types, args.games, args.turns, args.data_dir)))
        return
    console = Console()
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
    original = measured["original"]
    console.print(f"\n## ALFWorld engine ({original['games']} held-out games, {original['steps']} random steps)\n")
    print("| engine | env steps/s | ms/reset | step speedup | reset speedup | same text |")
    print("|---|---|---|---|---|---|")
    for side, label in SIDES.items():
        m = measured[side]
        print(f"| {label} | {m['steps'] / m['step_s']:.1f} | {1000 * m['reset_s'] / m['games']:.0f} "
              f"| {original['step_s'] / m['step_s']:.2f}x | {original['reset_s'] / m['reset_s']:.2f}x "
              f"| {'yes' if m['digest'] == original['digest'] else 'NO'} |")


if __name__ == "__main__":
    main()
