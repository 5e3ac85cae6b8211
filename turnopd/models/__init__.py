"""Models that run without a hub (see base.py): the registry of model preparations and the built-in
`tiny`, `tiny_vlm`, `screen_reader` and `smollm2-135m` ones, which register themselves on import."""

from turnopd.models import env_text, screen_reader, smollm2, vlm  # noqa: F401  (register the preparations)
from turnopd.models.base import (
    BUILD_INFO,
    MODEL_PREPARERS,
    MODELS_DIR,
    ModelPrepareError,
    building,
    default_model_dir,
    folder_builds,
    prepare_model,
    read_build_info,
    weights_fingerprint,
)

__all__ = ["BUILD_INFO", "MODELS_DIR", "MODEL_PREPARERS", "ModelPrepareError", "building", "default_model_dir", "folder_builds",
           "prepare_model", "read_build_info", "weights_fingerprint"]
