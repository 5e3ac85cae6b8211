"""Adapter: a gymnasium env id played as a text env (the `gymnasium` package, an extra:
pip install -e ".[gymnasium]"); imported lazily, in the spec's checks and the env-pool workers."""

from envs.base import ENVS
from envs.gymnasium.spec import GymnasiumSpec

ENVS.register("gymnasium")(GymnasiumSpec)

__all__ = ["GymnasiumSpec"]
