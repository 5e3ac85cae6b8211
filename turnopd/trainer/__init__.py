"""The DeepSpeed trainer of the student (see trainer.py)."""

from turnopd.trainer.trainer import Trainer, TrainingDiverged

__all__ = ["Trainer", "TrainingDiverged"]
