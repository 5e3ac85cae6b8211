"""The TextWorldExpress expert: the engine's gold path. The engine generates it with the game (every
game type has one) and the env sends it with the reset outcome, in info["gold_path"]. It runs in the
main process and sees only the outcomes the env returns.

The gold agents of coin and twc search by random walk with an unseeded generator (the engine's
`new scala.util.Random()`), so their paths, unlike their games, differ from run to run; they win all
the same. `turnopd sft` caches the episodes it played."""

from __future__ import annotations

from envs.base import StepOutcome

FALLBACK_ACTION = "look around"  # after the path (an episode that goes on): admissible in every game


class GoldPathExpert:
    def __init__(self, task_id: str):
        self.task_id = task_id
        self.plan: list[str] | None = None  # the actions still to play

    def act(self, outcome: StepOutcome) -> str:
        if self.plan is None:
            if "gold_path" not in outcome.info:
                raise ValueError(f"TextWorldExpress expert for {self.task_id}: its first outcome must be the "
                                 "reset outcome, whose info['gold_path'] holds the plan")
            self.plan = list(outcome.info["gold_path"])
        return self.plan.pop(0) if self.plan else FALLBACK_ACTION
