"""A vision-language student's screenshots, from pixel-store keys to pixel_values, fetched when a
batch is built (the policy's generation batch, the trainer's micro-batch), so that everything before
carries keys only (turnopd.core.pixels). It counts what it fetched: the bytes that did move, against
the pixel_values that would have travelled with the trajectories."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
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


# How a screen's character cells are laid out for the vision tower, a property of the model (its
# image processor's `screen_layout`, saved with it): "grid", the screen as drawn, each square patch a
# block of rows x columns of cells; "row_tiles", each patch `k` consecutive cells of one text row
# (k = the cells a patch holds) and the patches in reading order, so image token i holds characters
# 8i .. 8i + 7 of the page read row by row (patch 24, 96-column rows): a transcription copies the
# image tokens in order instead of reading half-patches across a row of patches.
SCREEN_LAYOUTS = ("grid", "row_tiles")


def tile_rows(image: np.ndarray, cell: tuple[int, int], patch: tuple[int, int]) -> np.ndarray:
    """`image` [H, W], a grid of cells of `cell` = (height, width) pixels, laid out so that each patch
    of `patch` = (tall, wide) cells holds tall x wide consecutive cells of one row (row-major inside the
    patch), the patches filling the same patch grid row-major in reading order. The same shape out; a
    cell's pixels are moved, never changed. E.g. cells of 1 x 1, patch (2, 2):
    [[a b c d], [e f g h]] -> [[a b e f], [c d g h]]."""
    (cell_h, cell_w), (tall, wide) = cell, patch
    rows, cols = image.shape[0] // cell_h, image.shape[1] // cell_w
    if rows * cell_h != image.shape[0] or cols * cell_w != image.shape[1] or rows % tall or cols % (tall * wide):
        raise ValueError(f"an image of {image.shape} is not whole cells of {cell} px in patches of {patch} cells "
                         "with each row a whole number of patches")
    cells = image.reshape(rows, cell_h, cols, cell_w).transpose(0, 2, 1, 3)  # [rows, cols, h, w]
    patches = cells.reshape(rows * cols // (tall * wide), tall, wide, cell_h, cell_w)  # reading order
    patches = patches.transpose(0, 1, 3, 2, 4).reshape(-1, tall * cell_h, wide * cell_w)
    grid_rows, grid_cols = rows // tall, cols // wide
    return patches.reshape(grid_rows, grid_cols, tall * cell_h, wide * cell_w).transpose(0, 2, 1, 3).reshape(image.shape)


def screen_layout(processor: LlavaProcessor) -> str:
    """The model's screen layout (SCREEN_LAYOUTS): its image processor's `screen_layout`, "grid" if unset."""
    return getattr(processor.image_processor, "screen_layout", "grid")


def model_screen(screen: np.ndarray, processor: LlavaProcessor, cell: tuple[int, int] | None = None) -> np.ndarray:
    """A uint8 [576, 576] screen as the model's tower sees it (its screen_layout): what the processor,
    or vLLM, is given. Any grid of the screen's cells moves the same way: `cell`, its cells' size in
    pixels (default the renderer's; (1, 1) for one character code a cell)."""
    if screen_layout(processor) == "grid":
        return screen
    from envs.webshop.screenshot import CELL_H, CELL_W

    size = processor.patch_size
    return tile_rows(np.asarray(screen), cell or (CELL_H, CELL_W), (size // CELL_H, size // CELL_W))


def screen_image(screen: np.ndarray) -> Image.Image:
    """A uint8 [576, 576] screen as the grayscale PIL image the processor (and vLLM) takes."""
    from PIL import Image

    return Image.fromarray(np.asarray(screen, dtype=np.uint8), mode="L")


def screen_pixel_values(screens: Sequence[np.ndarray], processor_or_dir: LlavaProcessor | str | os.PathLike[str]
                        ) -> torch.Tensor:
    """The model's pixel_values of uint8 [576, 576] screens (turnopd.models.vlm's tiny VLM, any Llava
    processor) in the model's screen layout: float32 [n, C, 576, 576], each pixel normalized by the
    processor (the tiny VLM's: v / 255 - 1, white 0), C = vision_config.num_channels (grayscale
    replicated if 3)."""
    processor = _processor(processor_or_dir)
    images = [screen_image(model_screen(s, processor)) for s in screens]
    return processor.image_processor(images=images, return_tensors="pt")["pixel_values"]


class MissingScreenshots(KeyError):
    """Screenshots asked for that are not (or no longer) in the pixel store."""


@dataclass(frozen=True)
class HeldScreens:
    """What freeing screenshots between steps must keep when episodes are played while steps train:
    no episode still playing (or played, not yet received) began before `since` (a time.time()), and
    `keys` are those of the trajectories received and not yet trained."""

    since: float
    keys: frozenset[str]


@dataclass
class FetchCounts:
    images: int = 0  # images handed out as pixel_values
    store_bytes: int = 0  # bytes read from the store (uint8 screens)
    pixel_value_bytes: int = 0  # bytes of the pixel_values made from them (what sending pixels would move)


class ScreenPixels:
    """`screens(keys)`: the [n, C, H, W] pixel_values of the keys' screenshots, in order, by the
    processor of the VLM in `model_dir` (screen_pixel_values); raises
    MissingScreenshots for keys not in the store (ask `missing` first). `model_dir` None: a student
    that reads the screens as text (a screen reader's), whose model takes no pixels: the store is
    still freed between steps, and no prompt holds an image to fetch."""

    def __init__(self, store: PixelStore, model_dir: str | os.PathLike[str] | None):
        from transformers import AutoProcessor

        self.store = store
        self.processor = AutoProcessor.from_pretrained(model_dir) if model_dir is not None else None
        self.counts = FetchCounts()
        # set by an asynchronous pipeline, whose generator plays while steps train: what to keep
        self.held: Callable[[], HeldScreens] | None = None

    def missing(self, keys: Sequence[str]) -> list[str]:
        return self.store.missing(keys)

    def take_counts(self) -> FetchCounts:
        """What was fetched since the last call or `free_between_steps` (a step's generation and
        training; in an asynchronous pipeline the generator process fetches its own, not counted here)."""
        counts, self.counts = self.counts, FetchCounts()
        return counts

    def free_between_steps(self) -> None:
        """Between steps: every screenshot no episode still needs freed (all of them when none plays
        meanwhile, the sync pipeline; else all but `held`'s), and what the evaluations just fetched
        left out of the next step's counts."""
        if self.held is None:
            self.store.clear()
        else:
            held = self.held()
            self.store.free_unheld(held.since, held.keys)
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


def attach_screens(spec: Any, model_dir: str | os.PathLike[str], *consumers: Any, reader: Any = None
                   ) -> ScreenPixels | None:
    """In an env that shows screenshots (envs.base.shows_screenshots): the student's pixel source over
    the env's pixel store, set as `screens` of each consumer (its policy, its trainer); None in an
    env of text. A text student that reads the screens through a screen reader (student.screen_reader,
    turnopd.models.screen_reader): `reader` set as `screen_reader` of each consumer (its policy, whose
    renderer shows each page as the text read), and the store's pixel source without a processor
    returned (the run frees the store through it; the model takes no pixels)."""
    from turnopd.loaders.hf_models import is_vision_language

    if not shows_screenshots(spec):
        return None
    if reader is not None:
        for consumer in consumers:
            consumer.screen_reader = reader
        return ScreenPixels(spec.pixel_store, None)
    if not is_vision_language(model_dir):
        raise ValueError(f"env {spec.name} shows screenshots, but the student {model_dir} has no vision tower; "
                         "use a vision-language model (e.g. `prepare: tiny_vlm`, turnopd.models.vlm)")
    screens = ScreenPixels(spec.pixel_store, model_dir)
    for consumer in consumers:
        consumer.screens = screens
    return screens


def attach_run_screens(spec: Any, student_dir: str | os.PathLike[str], policy: Any, teachers: Any,
                       reader: Any = None) -> ScreenPixels | None:
    """In an env that shows screenshots, the pixel sources of whatever plays and scores its episodes:
    the student's policy (returned: the trainer reads the same; its `reader`, when it reads the screens
    as text: attach_screens) and each teacher that reads screenshots (a VLM teacher, through its own
    processor); teachers: a mapping of them."""
    screens = attach_screens(spec, student_dir, policy, reader=reader)
    for teacher in (t for t in teachers.values() if t.reads_screenshots):
        attach_screens(spec, teacher.model_dir, teacher)
    return screens
