"""A multi-env step's play: the envs' shares at once (turnopd.orchestration.pipeline.mixture.play_mixture,
what sync does) vs one env after the other (each share played and scored as a single-env step is,
pipeline.plan.play_and_score: what sync did before), side by side in one process on the same models,
pools and plan.

    python benchmarks/mixture_play.py            # ~3 min on 2 cores: tiny random models

The mixture of recipes/multi/alfworld_search.yaml with the tiny random models of
`benchmarks/multi_env.py --smoke` (built in seconds), 8 ALFWorld episodes at a 12-turn horizon and 8
search ones at 4, 24 new tokens a turn (the ALFWorld recipe's), step 0's plan (every episode at its env's horizon). A random student rarely ends an
episode early, so ALFWorld's episodes play 12 turns and search's 4. At once, search's turns share
the generation batches of ALFWorld's first turns; one after the other, they are batches of their own.
Each side runs `--repeats` times, alternating, and reports its median with the range, and the ratio
of the two per repeat.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from multi_env import RECIPE, smoke_overrides
from record import MIN_REPEATS, Summary, save_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    args = parser.parse_args()

    from teachers import make_teachers
    from turnopd.core.ledger import Ledger
    from turnopd.loaders.hf_models import load_student
    from turnopd.orchestration.pipeline import env_parts, make_depth, open_pools, plan_step
    from turnopd.orchestration.pipeline.mixture import play_mixture
    from turnopd.orchestration.pipeline.plan import play_and_score, step_episodes
    from turnopd.orchestration.preflight import check_setup
    from turnopd.orchestration.recipe import load_recipe
    from turnopd.rollout import make_policy

    overrides = smoke_overrides(Path(tempfile.mkdtemp(prefix="mixture_play_")))
    cfg = load_recipe(RECIPE, [*overrides, "env.max_turns=12", "envs.search.max_turns=4",
                               "trainer.episodes_per_step=16", "policy.max_new_tokens=24"])
    setup, _ = check_setup(cfg)
    student, tokenizer = load_student(setup.student_path, "float32", None)
    policy = make_policy(cfg.policy, student, tokenizer=tokenizer, seed=0)
    teachers, parts = make_teachers(setup.teacher_specs), env_parts(cfg, setup)
    plan = plan_step(make_depth(cfg), 0, cfg)

    def in_turn(pools) -> list:
        return [t for env, env_plan in plan.envs.items() for t in play_and_score(
            parts[env][0], parts[env][1].spec, pools[env], policy, teachers,
            step_episodes(parts[env][0], parts[env][1].train_tasks, env_plan), Ledger())]

    sides = {"at once": lambda pools: play_mixture(cfg, setup, pools, policy, teachers, plan, Ledger()),
             "one env after the other": in_turn}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    turns: dict[str, list[int]] = {side: [] for side in sides}
    with open_pools(cfg, setup) as pools:
        play_mixture(cfg, setup, pools, policy, teachers, plan, Ledger())  # warm-up: the env workers' first games
        for _ in range(args.repeats):
            for side, play in sides.items():
                start = time.perf_counter()
                trajectories = play(pools)
                seconds[side].append(time.perf_counter() - start)
                turns[side].append(sum(t.depth for t in trajectories))
    summaries = [Summary.of(f"{side}: seconds a step (16 episodes, {turns[side][0]} turns)", seconds[side], "s")
                 for side in sides]
    summaries.append(Summary.of("one after the other / at once", [b / a for a, b in zip(*seconds.values(), strict=True)], "x"))
    save_result("mixture_play", "a multi-env step's play: the envs at once vs one env after the other (tiny "
                "random models, ALFWorld 12 turns + search 4)", summaries,
                [{"side": side, "seconds": seconds[side], "turns": turns[side]} for side in sides],
                notes="Tiny random models: generation is cheap, so a step is mostly env and scheduling time; "
                      "read the ratio's range before a gain.")


if __name__ == "__main__":
    main()
