"""A vision-language student's screenshots, from pixel-store keys to pixel_values, fetched when a
batch is built (the policy's generation batch, the trainer's micro-batch), so that everything before
carries keys only (turnopd.core.pixels). It counts what it fetched: the bytes that did move, against
the pixel_values that would have travelled with the trajectories."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from envs.base import shows_screenshots
from turnopd.core.pixels import PixelStore

if TYPE_CHECKING:
    from PIL import Image
    from transformers import LlavaProcessor


def _processor(processor_or_dir: LlavaProcessor | str | os.PathLike[str]) -> LlavaProcessor:
    if isinstance(processor_or_dir, (str, os.PathLike)):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(processor_or_dir)
    return processor_or_dir


def screen_image(screen: np.ndarray) -> Image.Image:
    """A uint8 [576, 576] screen as the grayscale PIL image the processor (and vLLM) takes."""
    from PIL import Image

    return Image.fromarray(np.asarray(screen, dtype=np.uint8), mode="L")


def screen_pixel_values(screens: Sequence[np.ndarray], processor_or_dir: LlavaProcessor | str | os.PathLike[str]
                        ) -> torch.Tensor:
    """The model's pixel_values of uint8 [576, 576] screens (turnopd.models.vlm's tiny VLM, any Llava
    processor): float32 [n, C, 576, 576], each pixel (v / 255 - 0.5) / 0.5 in [-1, 1], C =
    vision_config.num_channels (grayscale replicated if 3)."""
    processor = _processor(processor_or_dir)
    return processor.image_processor(images=[screen_image(s) for s in screens], return_tensors="pt")["pixel_values"]


class MissingScreenshots(KeyError):
    """Screenshots asked for that are not (or no longer) in the pixel store."""


@dataclass
class FetchCounts:
    images: int = 0  # images handed out as pixel_values
    store_bytes: int = 0  # bytes read from the store (uint8 screens)
    pixel_value_bytes: int = 0  # bytes of the pixel_values made from them (what sending pixels would move)


class ScreenPixels:
    """`screens(keys)`: the [n, C, H, W] pixel_values of the keys' screenshots, in order, by the
    processor of the VLM in `model_dir` (screen_pixel_values); raises
    MissingScreenshots for keys not in the store (ask `missing` first)."""

    def __init__(self, store: PixelStore, model_dir: str | os.PathLike[str]):
        from transformers import AutoProcessor

        self.store = store
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.counts = FetchCounts()

    def missing(self, keys: Sequence[str]) -> list[str]:
        return self.store.missing(keys)

    def take_counts(self) -> FetchCounts:
        """What was fetched since the last call or `free_all` (a step's generation and training)."""
        counts, self.counts = self.counts, FetchCounts()
        return counts

    def free_all(self) -> None:
        """Between steps (sync pipeline: no episode in flight): every screenshot freed, and what the
        evaluations just fetched left out of the next step's counts."""
        self.store.clear()
        self.counts = FetchCounts()

    def __call__(self, keys: Sequence[str]) -> torch.Tensor:
        found = self.store.get(keys)
        lost = [key for key in keys if key not in found]
        if lost:
            raise MissingScreenshots(f"{len(lost)} of {len(keys)} screenshots are not in the pixel store "
                                     f"{self.store.root} (first: {lost[0]})")
        screens = [found[key] for key in keys]
        pixel_values = screen_pixel_values(screens, self.processor)
        self.counts.images += len(keys)
        self.counts.store_bytes += sum(screen.nbytes for screen in screens)
        self.counts.pixel_value_bytes += pixel_values.nelement() * pixel_values.element_size()
        return pixel_values


def attach_screens(spec: Any, model_dir: str | os.PathLike[str], *consumers: Any) -> ScreenPixels | None:
    """In an env that shows screenshots (envs.base.shows_screenshots): the student's pixel source over
    the env's pixel store, set as `screens` of each consumer (its policy, its trainer); None in an
    env of text."""
    from turnopd.loaders.hf_models import is_vision_language

    if not shows_screenshots(spec):
        return None
    if not is_vision_language(model_dir):
        raise ValueError(f"env {spec.name} shows screenshots, but the student {model_dir} has no vision tower; "
                         "use a vision-language model (e.g. `prepare: tiny_vlm`, turnopd.models.vlm)")
    screens = ScreenPixels(spec.pixel_store, model_dir)
    for consumer in consumers:
        consumer.screens = screens
    return screens
