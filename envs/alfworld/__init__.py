"""ALFWorld (alfworld 0.4.2 + TextWorld) on the json_2.1.1 games; the engine is imported lazily."""

from envs import ENVS
from envs.alfworld.spec import AlfworldSpec

ENVS.register("alfworld")(AlfworldSpec)

__all__ = ["AlfworldSpec"]
