"""Environments, one package each, registered by name (ENVS.get(name)(config, data_dir) -> EnvSpec)."""

from __future__ import annotations

import importlib
from typing import Any

from envs.base import ENVS, EnvSpec

# Each module registers its EnvSpec class in ENVS (envs.base) on import; they import their engines
# lazily. `turnopd new env NAME` appends to this line.
BUILTIN_ENVS = ("envs.alfworld", "envs.webshop", "envs.search", "envs.twx", "envs.prompts", "envs.autoresearch")
for _module in BUILTIN_ENVS:
    importlib.import_module(_module)


def make_env_spec(config: Any, data_dir: str | None = None) -> EnvSpec:
    """The EnvSpec that a recipe's `env` block (turnopd.config.EnvConfig) names."""
    return ENVS.get(config.name)(config, data_dir)


__all__ = ["BUILTIN_ENVS", "ENVS", "EnvSpec", "make_env_spec"]
