"""The `screen_reader` model preparation: a glyph reader that turns a WebShop screenshot
(envs/webshop/screenshot.py) into the text it reads, the eyes of a read-then-act student
(docs/results/screen-reader-design.md).

A SigLIP vision tower shaped as the tiny VLM's (turnopd.models.vlm: patches of whole character
cells, the shared cell-encoder init, white pixels 0, a screen layout) and its CellReader, a linear
read-out of every cell's character from its patch's feature, trained together on the per-cell loss
alone (vlm.cell_loss) over the distinct pages of WebShop expert train episodes. There is no language
model: reading a screen is each cell's most likely character, put back where the cell is on the
screen, each row right-stripped and the blank rows at the end dropped, i.e. the page's lines as
drawn ("\\n"-joined, as vlm.PageShot.text). Whatever reads the text after it is not trained through it.

Folder: the tower (transformers' SiglipVisionModel), its image processor (with the screen layout),
the reader's weights (cell_reader.safetensors) and the build record, whose "reading" holds the
reading test on held-out test-split pages (`reading_test`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import turnopd.models.vlm as vlm
from turnopd.loaders.screens import model_screen, screen_pixel_values
from turnopd.models.base import MODEL_PREPARERS, building, prepare_model

if TYPE_CHECKING:
    from transformers import SiglipImageProcessorPil, SiglipVisionModel

READER_WEIGHTS = "cell_reader.safetensors"


@dataclass(frozen=True)
class ReaderProcessor:
    """What vlm's screen helpers take of a processor: the image processor (its screen_layout) and
    the patch size."""

    image_processor: SiglipImageProcessorPil
    patch_size: int


class ScreenReader(torch.nn.Module):
    """A tower and its cell reader: `read(screens)`, the text of each uint8 [576, 576] screen."""

    def __init__(self, tower: SiglipVisionModel, reader: vlm.CellReader, image_processor: SiglipImageProcessorPil):
        super().__init__()
        self.tower, self.reader = tower, reader
        self.processor = ReaderProcessor(image_processor, tower.config.patch_size)
        self.cell_of = screen_cells(self.processor)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, C, 576, 576] -> logits [n, patches, cells per patch, CELL_CLASSES]."""
        return self.reader(vlm.patch_features(self.tower, pixel_values))

    @torch.no_grad()
    def read(self, screens: Sequence[np.ndarray]) -> list[str]:
        self.eval()
        codes = self(screen_pixel_values(screens, self.processor)).argmax(-1)
        return [screen_text(page, self.cell_of) for page in codes]


def screen_cells(processor: Any, rows: int = 48, cols: int = 96) -> torch.Tensor:
    """[patches, cells per patch]: the screen cell (row x cols + column) each of the reader's outputs
    reads, in the processor's screen layout (its cells move as vlm.cell_labels moves the labels)."""
    index = np.arange(rows * cols).reshape(rows, cols)
    return vlm.patch_cells(torch.as_tensor(model_screen(index, processor, cell=(1, 1))), processor.patch_size)


def screen_text(codes: torch.Tensor, cell_of: torch.Tensor, rows: int = 48, cols: int = 96) -> str:
    """The text of one screen's codes [patches, cells per patch] (Latin-1, as vlm.cell_grid draws
    them): each code put back in its cell (`cell_of`), rows right-stripped, blank rows at the end dropped."""
    grid = torch.empty(rows * cols, dtype=torch.long)
    grid[cell_of.reshape(-1)] = codes.reshape(-1)
    lines = [bytes(row.tolist()).decode("latin-1").rstrip() for row in grid.view(rows, cols)]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def new_screen_reader(*, hidden_size: int = 512, layers: int = 1, heads: int = 2, intermediate_size: int | None = None,
                      patch_size: int = vlm.PATCH_SIZE, num_channels: int = 3, screen_layout: str = "row_tiles",
                      seed: int = 0) -> ScreenReader:
    """A random-init reader (the tower's patch embedding starts as the shared cell encoder)."""
    from transformers import SiglipVisionModel

    from envs.webshop.screenshot import CELL_H, CELL_W

    vlm.check_screen_options(patch_size, num_channels, screen_layout)
    config = vlm.tower_config(hidden_size=hidden_size, layers=layers, heads=heads, intermediate_size=intermediate_size,
                              patch_size=patch_size, num_channels=num_channels)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        tower = SiglipVisionModel(config)
        vlm.init_cell_patches(tower.embeddings.patch_embedding)
        reader = vlm.CellReader(hidden_size, (patch_size // CELL_W) * (patch_size // CELL_H))
    return ScreenReader(tower, reader, vlm.build_image_processor(num_channels, screen_layout))


def train_reader(reader: ScreenReader, pages: Sequence[vlm.PageShot], *, steps: int, batch_size: int, lr: float,
                 seed: int = 0, log_every: int = 0) -> list[float]:
    """`steps` steps of vlm.train_on_pages on the per-cell loss; returns each step's loss."""
    def step_loss(chosen: list[vlm.PageShot]) -> tuple[torch.Tensor, torch.Tensor, str]:
        loss = vlm.cell_loss(reader(screen_pixel_values([p.pixels for p in chosen], reader.processor)),
                             vlm.cell_labels(chosen, reader.processor))
        return loss, loss, f"cells {loss.item():.3f}"

    return vlm.train_on_pages([reader], pages, step_loss, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                              log_every=log_every, label="reader")


def save_screen_reader(reader: ScreenReader, folder: Path) -> None:
    reader.tower.save_pretrained(folder)
    reader.processor.image_processor.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in reader.reader.state_dict().items()}, folder / READER_WEIGHTS,
              metadata={"format": "pt"})


def load_screen_reader(folder: str | Path) -> ScreenReader:
    from transformers import AutoImageProcessor, SiglipVisionModel

    folder = Path(folder)
    tower = SiglipVisionModel.from_pretrained(folder)
    weights = load_file(folder / READER_WEIGHTS)
    reader = vlm.CellReader(tower.config.hidden_size, weights["linear.weight"].shape[0] // vlm.CELL_CLASSES)
    reader.load_state_dict(weights)
    return ScreenReader(tower, reader, AutoImageProcessor.from_pretrained(folder)).eval()


def reader_folder(model: Any) -> Path | None:
    """The screen reader folder of a recipe's model block (its `screen_reader`), built there by this
    preparation with its defaults when missing; None when it names none."""
    if getattr(model, "screen_reader", None) is None:
        return None
    folder = Path(model.screen_reader).expanduser()
    if not folder.exists():
        prepare_model("screen_reader", folder)
    return folder


def reader_for(model: Any) -> ScreenReader | None:
    """The screen reader of a recipe's model block, loaded (reader_folder); None when it names none."""
    folder = reader_folder(model)
    return None if folder is None else load_screen_reader(folder)


def page_reading(reader: ScreenReader, screen: np.ndarray, page: vlm.PageShot) -> dict[str, float]:
    """How well the reader gives `page` from `screen` (its own, or another page's): the share of the
    page's text cells (non-blank) read right (vlm.cell_accuracy), the character accuracy (1 - CER) of
    the text read, and the share of the page's lines read exactly (an action copies a whole line)."""
    shown = vlm.PageShot(screen, page.text)
    return {"cell_accuracy": vlm.cell_accuracy(reader.tower, reader.reader, reader.processor, [shown]),
            **text_reading(reader.read([screen])[0], page.text)}


def text_reading(read: str, text: str) -> dict[str, float]:
    """Character accuracy (1 - CER) of `read` against `text`, and the share of text's lines read
    exactly, line i against line i."""
    lines = text.split("\n")
    return {"char_accuracy": vlm.character_accuracy(read, text),
            "lines_exact": sum(a == b for a, b in zip(lines, read.split("\n"), strict=False)) / len(lines)}


def reading_test(reader: ScreenReader, pages: Sequence[vlm.PageShot]) -> list[dict[str, float]]:
    """The test of reading, per held-out page: page_reading from its own screen, and (suffix
    "_swapped") from another page's (vlm.swapped_screens: page i under screen i + 1)."""
    return [{**page_reading(reader, page.pixels, page),
             **{f"{k}_swapped": v for k, v in page_reading(reader, other.pixels, page).items()}}
            for page, other in zip(pages, vlm.swapped_screens(pages), strict=True)]


def reading_summary(per_page: Sequence[dict[str, float]]) -> dict[str, float]:
    """The means over the pages of each reading_test figure."""
    return {key: statistics.fmean(page[key] for page in per_page) for key in per_page[0]}


def reading_pages(episodes: int, eval_episodes: int, data_dir: str | None = None, seed: int = 0
                  ) -> tuple[list[vlm.PageShot], list[vlm.PageShot]]:
    """The distinct pages of `episodes` expert train-split episodes (to train on), and those of
    `eval_episodes` test-split episodes that none of them shows (held out)."""
    train = vlm.play_pages("train", episodes, data_dir, seed)
    seen = {p.text for p in train}
    return train, [p for p in vlm.play_pages("test", eval_episodes, data_dir, seed) if p.text not in seen]


@MODEL_PREPARERS.register("screen_reader")
def prepare_screen_reader(out_dir: Path, *, data_dir: str | None = None, episodes: int = 100, eval_episodes: int = 40,
                          steps: int = 300, batch_size: int = 4, lr: float = 3e-3, seed: int = 0, **size: Any) -> Path:
    """A reader in out_dir: new_screen_reader(**size, seed) trained `steps` steps (batch_size, lr) on the
    distinct pages of `episodes` expert train-split episodes; the reading test on every distinct page of
    `eval_episodes` test-split episodes (none a train page) goes into the build record."""
    start = time.perf_counter()
    reader = new_screen_reader(seed=seed, **size)
    train_pages, held_out = reading_pages(episodes, eval_episodes, data_dir, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        losses = train_reader(reader, train_pages, steps=steps, batch_size=batch_size, lr=lr, seed=seed, log_every=50)
    train_seconds = time.perf_counter() - start
    per_page = reading_test(reader, held_out)
    reading = {"train_pages": len(train_pages), "held_out_pages": len(held_out), "steps": steps,
               "batch_size": batch_size, "lr": lr, "first_loss": losses[0], "last_loss": statistics.fmean(losses[-10:]),
               "train_seconds": round(train_seconds, 1), **reading_summary(per_page)}
    info = {"builder": "screen_reader", "options": {**size, "seed": seed}, "parameters": sum(
        p.numel() for p in reader.parameters()), "reading": reading}
    with building(Path(out_dir), info) as tmp:
        save_screen_reader(reader, tmp)
    print(f"screen_reader: {info['parameters'] / 1e6:.2f}M parameters, {len(train_pages)} train pages, {steps} steps; "
          f"{len(held_out)} held-out pages: text cells read {reading['cell_accuracy']:.3f} (from another page's screen "
          f"{reading['cell_accuracy_swapped']:.3f}), character accuracy {reading['char_accuracy']:.3f}, lines exact "
          f"{reading['lines_exact']:.3f} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    return Path(out_dir)
