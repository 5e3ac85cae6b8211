"""The OpenEnv adapter's EnvSpec: one OpenEnv environment server as a text env.

Options:
  url              a running server (http://host:port), or
  app, app_dir     the server's ASGI app (e.g. server.app:app) and the env package's folder: each env
                   worker starts one (`python -m uvicorn`), and starts it again if it died
  action_field     the action's text field (the echo env's "message")
  observation_field  the observation field shown (default: every field, "name: value" lines)
  success_reward   a done episode whose last reward is at least this is won (default 1.0)
  task             the goal the prompt states; train_tasks, test_tasks: seeds per split
  timeout_s        the wait for a server answer or start; retries: extra tries to connect
A server that dies or stops answering ends its episode with env_error; the next episode reconnects
(a local server is started again). envs/openenv/env.py states how answers map to outcomes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, NoReturn

from envs.adapters import SeedTasks
from envs.base import ParsedAction, extract_action
from envs.openenv.env import OpenEnvEnv

INSTALL = 'pip install -e ".[openenv]"'
OPTIONS: dict[str, Any] = {"url": None, "app": None, "app_dir": ".", "action_field": "message",
                           "observation_field": None, "success_reward": 1.0, "task": "answer the environment",
                           "train_tasks": 200, "test_tasks": 50, "timeout_s": 30.0, "retries": 3}


def check_options(options: dict[str, Any]) -> None:
    if importlib.util.find_spec("websockets") is None:
        raise ValueError(f"env openenv needs the websockets package, which is not installed: {INSTALL}")
    if bool(options["url"]) == bool(options["app"]):
        raise ValueError("env openenv needs exactly one of option `url` (a running server) and option `app` "
                         "(the server's ASGI app to start, e.g. env.options.app=server.app:app)")
    if options["app"] and not Path(options["app_dir"]).is_dir():
        raise ValueError(f"env openenv option app_dir {options['app_dir']!r} is not a folder")
    if options["timeout_s"] <= 0 or options["retries"] < 0:
        raise ValueError("env openenv options timeout_s must be > 0 and retries >= 0")


class OpenEnvSpec(SeedTasks):
    name = "openenv"
    task_kind = "openenv"
    default_max_turns = 10
    observation_version = "1"

    def __init__(self, config: Any, data_dir: str | None = None):
        # data_dir is not used; the server is not contacted here (a recipe check stays offline)
        self.options = self.check_block(config, OPTIONS)
        self.check_task_types()
        check_options(self.options)

    def make(self) -> OpenEnvEnv:
        return OpenEnvEnv(self.options, self.options["task"])

    def expert(self, task_id: str) -> NoReturn:
        raise ValueError("env openenv has no expert (an OpenEnv server has none to give)")

    def parse_action(self, text: str) -> ParsedAction:
        return extract_action(text)
