"""Environments, one package each, registered by name (ENVS.get(name)(config, data_dir) -> EnvSpec)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from envs.base import EnvSpec
from turnopd.registry import Registry

ENVS: Registry[Callable[..., EnvSpec]] = Registry("env")

# Each module registers its EnvSpec class on import; they import their engines lazily.
BUILTIN_ENVS = ("envs.alfworld", "envs.webshop", "envs.search", "envs.twx")
for _module in BUILTIN_ENVS:
    importlib.import_module(_module)


def make_env_spec(config: Any, data_dir: str | None = None) -> EnvSpec:
    """The EnvSpec that a recipe's `env` block (turnopd.config.EnvConfig) names."""
    return ENVS.get(config.name)(config, data_dir)
