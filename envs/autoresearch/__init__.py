"""Autoresearch: tune a small training job one knob at a time, every step a real training run (an
MLP on datasets made from installed packages). The costly env whose results are memoised exactly."""

from envs.autoresearch.spec import AutoresearchSpec
from envs.base import ENVS

ENVS.register("autoresearch")(AutoresearchSpec)

__all__ = ["AutoresearchSpec"]
