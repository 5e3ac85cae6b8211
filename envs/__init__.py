"""Environments, registered by name (ENVS.get(name)(config, data_dir) -> EnvSpec): this checkout's
built-in envs and those of installed packages (plugins).

A package registers its envs through the entry-point group `turnopd.envs`, one entry per env naming
its EnvSpec class (in its pyproject.toml):

    [project.entry-points."turnopd.envs"]
    guess = "turnopd_guess:GuessSpec"

The built-in envs are declared the same way in turnopd's own pyproject.toml, and are also imported
from BUILTIN_ENVS: an editable install reads its entry points from the metadata written when it was
installed, which may predate an env of the checkout.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from envs.base import ENVS, EnvSpec

ENTRY_POINT_GROUP = "turnopd.envs"

# Each module registers its EnvSpec class in ENVS (envs.base) on import; they import their engines
# lazily. `turnopd new env NAME` appends to this line.
BUILTIN_ENVS = ("envs.alfworld", "envs.webshop", "envs.search", "envs.twx", "envs.prompts", "envs.autoresearch",
                "envs.gymnasium", "envs.openenv", "envs.verifiers")
for _module in BUILTIN_ENVS:
    importlib.import_module(_module)


def load_plugins() -> dict[str, str]:
    """Register the EnvSpec class of each `turnopd.envs` entry point under the entry's name. A plugin
    that fails to load is left out, so that it breaks no other env; its error (env name -> message) is
    raised when a recipe names it."""
    errors = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            spec_class = entry.load()
            if getattr(spec_class, "name", None) != entry.name:
                raise ValueError(f"its class's `name` is {getattr(spec_class, 'name', None)!r}, not {entry.name!r}")
            ENVS.register(entry.name)(spec_class)
        except Exception as exc:  # an installed package's bug: reported where its env is asked for
            errors[entry.name] = f"env plugin {entry.name!r} ({entry.value}) failed to load: {type(exc).__name__}: {exc}"
    return errors


PLUGIN_ERRORS = load_plugins()


def make_env_spec(config: Any, data_dir: str | None = None) -> EnvSpec:
    """The EnvSpec that a recipe's `env` block (turnopd.config.EnvConfig) names."""
    if config.name in PLUGIN_ERRORS and config.name not in ENVS:
        raise ValueError(PLUGIN_ERRORS[config.name])
    return ENVS.get(config.name)(config, data_dir)


__all__ = ["BUILTIN_ENVS", "ENTRY_POINT_GROUP", "ENVS", "EnvSpec", "PLUGIN_ERRORS", "make_env_spec"]
