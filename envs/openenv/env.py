"""One OpenEnv episode at a time, inside an env-pool worker.

The mapping: task "seed-N" resets with seed N; an action is sent as the action's text field
(`action_field`, e.g. the echo env's "message"); the observation is the answer's `observation_field`,
or all its fields as "name: value" lines; reward is the server's (None: 0); done is the server's; a
done episode is won when its last reward reaches `success_reward`.
"""

from __future__ import annotations

from typing import Any

from envs.adapters import seed_of
from envs.base import StepOutcome
from envs.openenv.client import LocalServer, Session

NOT_OBSERVED = ("done", "reward", "metadata")


class OpenEnvEnv:
    def __init__(self, options: dict[str, Any], task: str):
        self.options, self.task = options, task
        self.server = LocalServer(options["app"], options["app_dir"], options["timeout_s"]) if options["app"] else None
        self.session: Session | None = None

    def outcome(self, data: dict[str, Any]) -> StepOutcome:
        observation = data.get("observation") or {}
        field = self.options["observation_field"]
        text = (str(observation.get(field, "")) if field else
                "\n".join(f"{key}: {value}" for key, value in observation.items() if key not in NOT_OBSERVED))
        reward = float(data.get("reward") or 0.0)
        done = bool(data.get("done"))
        return StepOutcome(text, reward=reward, done=done, won=done and reward >= self.options["success_reward"])

    def reset(self, task_id: str) -> StepOutcome:
        url = self.server.ensure_running() if self.server else self.options["url"]
        self.session = Session(url, self.options["timeout_s"], self.options["retries"])
        self.session.connect()
        outcome = self.outcome(self.session.request("reset", {"seed": seed_of(task_id)}))
        outcome.info["task"] = self.task
        return outcome

    def step(self, action: str) -> StepOutcome:
        return self.outcome(self.session.request("step", {self.options["action_field"]: action}))

    def close(self) -> None:  # the episode's end: the session closes, a local server stays for the next one
        if self.session is not None:
            self.session.close()
