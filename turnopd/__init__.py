"""TurnOPD: turn-aware on-policy distillation of long-horizon LLM agents."""

__version__ = "0.1.0"
