"""Adapter: a taskset of the verifiers library (verifiers.v1, with its Env) played as a chat env (the
extra: pip install -e ".[verifiers]"); imported lazily, in the spec's checks and the env-pool workers."""

from envs.base import ENVS
from envs.verifiers.spec import VerifiersSpec

ENVS.register("verifiers")(VerifiersSpec)

__all__ = ["VerifiersSpec"]
