"""Adapter: an OpenEnv environment server (openenv-core), played over its WebSocket session; started
locally from the env's package, or reached at a URL (the extra: pip install -e ".[openenv]")."""

from envs.base import ENVS
from envs.openenv.spec import OpenEnvSpec

ENVS.register("openenv")(OpenEnvSpec)

__all__ = ["OpenEnvSpec"]
