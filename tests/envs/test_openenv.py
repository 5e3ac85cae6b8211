"""The OpenEnv adapter on OpenEnv's own echo env (the env `openenv init` writes, served by openenv-core's
server): episodes through the pool with a server the adapter starts, a server killed mid-episode, bad
options. Skips without the `openenv` extra."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from envs import make_env_spec
from envs.openenv.client import LocalServer, free_port
from envs.pool import EnvPool
from tests.conftest import hide_package
from turnopd.config import EnvConfig

pytest.importorskip("openenv.core")
pytest.importorskip("websockets")

READY = "echoed_message: Echo Demo environment ready!\nmessage_length: 0"


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The env package that OpenEnv's CLI scaffolds: an echo env (reward 0.1 per character, never done)."""
    root = tmp_path_factory.mktemp("openenv")
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_demo"], cwd=root, check=True,
                   capture_output=True, timeout=120)
    return root / "echo_demo"


def config(**options) -> EnvConfig:
    # a server's start imports openenv-core's stack (fastapi, fastmcp...): tens of seconds on 2 busy cores
    return EnvConfig(name="openenv", options={"train_tasks": 2, "test_tasks": 1, "timeout_s": 120, **options})


def test_episodes_through_the_pool_on_a_server_the_adapter_starts(echo_env: Path) -> None:
    spec = make_env_spec(config(app="server.app:app", app_dir=str(echo_env), task="echo my words"))
    assert spec.tasks("train") == ["seed-0", "seed-1"] and spec.tasks("test") == ["seed-2"]
    with EnvPool(spec, num_workers=1, step_timeout_s=120) as pool:
        start = pool.reset(["seed-0", "seed-1"])
        assert [o.observation for o in start] == [READY, READY] and start[0].info["task"] == "echo my words"
        outcome = pool.step({0: "hello", 1: "hi"})
        assert outcome[0].observation == "echoed_message: hello\nmessage_length: 5"
        assert outcome[1].observation == "echoed_message: hi\nmessage_length: 2"
        # the echo env's reward is 0.1 per character; it never ends an episode
        assert (outcome[0].reward, outcome[1].reward) == (pytest.approx(0.5), pytest.approx(0.2))
        assert not outcome[0].done and not outcome[0].won


def test_a_server_killed_mid_episode_ends_it_with_env_error_and_the_pool_goes_on(echo_env: Path) -> None:
    server = LocalServer("server.app:app", str(echo_env), timeout_s=60)
    url = server.ensure_running()
    spec = make_env_spec(config(url=url.replace("ws://", "http://"), timeout_s=5, retries=1))
    try:
        with EnvPool(spec, num_workers=1, step_timeout_s=60) as pool:
            assert pool.reset(["seed-0"])[0].observation == READY
            assert pool.step({0: "one"})[0].observation == "echoed_message: one\nmessage_length: 3"
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
            lost = pool.step({0: "two"})[0]
            assert (lost.done, lost.won) == (True, False)
            assert lost.info["env_error"].startswith(f"OpenEnvError: the OpenEnv server at {url.replace('ws://', 'http://')} "
                                                     "stopped answering during step")
            unreachable = pool.reset(["seed-1"])[0]  # no server: 2 tries, then the episode ends
            assert re.fullmatch(r"OpenEnvError: cannot reach the OpenEnv server at ws://.*/ws \(2 tries\): .*",
                                unreachable.info["env_error"])
            # the server back on its port: the next episode plays
            server = LocalServer("server.app:app", str(echo_env), timeout_s=60, port=int(url.rsplit(":", 1)[1]))
            server.ensure_running()
            again = pool.reset(["seed-1"])[0]
            assert again.observation == READY and "env_error" not in again.info
    finally:
        server.stop()


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "env openenv needs exactly one of option `url` (a running server) and option `app`"),
        ({"url": "http://127.0.0.1:9", "app": "server.app:app"}, "env openenv needs exactly one of option `url`"),
        ({"app": "server.app:app", "app_dir": "/nonexistent"}, "env openenv option app_dir '/nonexistent' is not a folder"),
        ({"url": "http://127.0.0.1:9", "colour": "red"}, "unknown openenv options ['colour']; allowed: url, app"),
    ],
)
def test_bad_options_are_refused_without_contacting_a_server(options, message, no_network) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        make_env_spec(config(**options))


def test_without_websockets_the_error_gives_the_install_line(monkeypatch) -> None:
    hide_package(monkeypatch, "websockets")
    with pytest.raises(ValueError, match=r"^env openenv needs the websockets package, which is not installed: "
                                         r"pip install -e \"\.\[openenv\]\"$"):
        make_env_spec(config(url=f"http://127.0.0.1:{free_port()}"))
