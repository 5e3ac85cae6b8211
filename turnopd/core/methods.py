"""The compared methods. Each is a recipe fragment in recipes/methods/<name>.yaml (methods differ
only in config); recipes compose them with `defaults:`, and the sweep applies them as overrides."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from turnopd.core.data import REPO_ROOT

METHODS_DIR = REPO_ROOT / "recipes" / "methods"
_UNRESOLVED = object()  # equal to no recipe value


def _flat(node: object, prefix: str = "") -> dict[str, object]:
    """A nested mapping as {"a.b": value}."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def _fragment(path: Path) -> dict[str, object]:
    return _flat(OmegaConf.to_container(OmegaConf.load(path)))


# name -> its recipe keys, e.g. "turnopd" -> {"depth.mode": "adaptive", "loss.mode": "progressive"}
FRAGMENTS: dict[str, dict[str, object]] = {path.stem: _fragment(path) for path in sorted(METHODS_DIR.glob("*.yaml"))}
# name -> its recipe overrides, e.g. "turnopd" -> ["depth.mode=adaptive", "loss.mode=progressive"]
METHODS: dict[str, list[str]] = {name: [f"{k}={v}" for k, v in keys.items()] for name, keys in FRAGMENTS.items()}


def _resolved(value: object, config: dict) -> object:
    """A fragment's value with its interpolations (e.g. "runs/world_models/${env.name}") resolved
    against the recipe; one the recipe cannot resolve matches nothing."""
    if isinstance(value, str) and "${" in value:
        try:
            return OmegaConf.create({**config, "_value": value})["_value"]
        except OmegaConfBaseException:
            return _UNRESOLVED
    return value


def method_of(config: dict) -> str:
    """The method a resolved recipe (a nested mapping) is: the fragment all of whose keys it has,
    the most specific one when several do (turnopd_continuous over turnopd), or
    'depth=<..>,loss=<..>' when none does."""
    flat = _flat(config)
    matches = [name for name, keys in FRAGMENTS.items()
               if all(flat.get(k) == _resolved(v, config) for k, v in keys.items())]
    if matches:
        return max(matches, key=lambda name: len(FRAGMENTS[name]))
    return f"depth={flat.get('depth.mode')},loss={flat.get('loss.mode')}"
