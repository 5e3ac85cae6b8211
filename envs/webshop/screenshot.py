"""WebShop's pages as screenshots: each page drawn on a fixed monospace grid, the way a browser
would show it, for agents that read pixels.

The page's visible texts are laid out one per line (wrapped at the grid's width), clickable texts
in brackets as buttons and links, on a white screen of `rows` x `cols` character cells drawn in
Pillow's built-in 6x11 bitmap font (it ships with Pillow, so a page renders to the same pixels on
every machine; ~1.5 ms a page). Text below the last row is cut, as a browser window cuts a long page,
and the last row then says so. `ScreenshotEnv` wraps the text env: the same actions, rewards and
observations, plus the screenshot of every page, put into a pixel store (turnopd.core.pixels) whose
key the outcome carries in `info["screenshot"]`; the pixels themselves never travel with it.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from envs.base import StepOutcome
from envs.webshop.env import SEARCH_ACTION, WebShopEnv
from envs.webshop.spec import WebShopSpec
from turnopd.core.pixels import PixelStore, default_pixel_root

CELL_W, CELL_H = 6, 12  # a character cell: the 6x11 bitmap font and one pixel of line spacing
CUT_MARK = "..."


@dataclass(frozen=True)
class Screen:
    """The grid a page is drawn on: cols x rows character cells of CELL_W x CELL_H pixels."""

    cols: int = 96
    rows: int = 48

    @property
    def size(self) -> tuple[int, int]:  # (width, height) in pixels
        return self.cols * CELL_W, self.rows * CELL_H


def page_lines(observation: str, admissible: list[str] | None, screen: Screen) -> list[str]:
    """A page's text as the screen shows it, from what the text env says of the page (its visible
    texts joined by " [SEP] ", its admissible actions): one visible text per line, wrapped at the
    grid's width, the clickable ones (click[x] targets, and the search button where the page has a
    search bar) in brackets; at most `screen.rows` lines, the last one saying "..." when the page
    goes on below. From the outcome alone, so a cached demonstration renders as the env did."""
    clickables = {action[len("click["):-1] for action in admissible or [] if action.startswith("click[")}
    if SEARCH_ACTION in (admissible or []):
        clickables.add("search")
    lines: list[str] = []
    for text in observation.split(" [SEP] "):
        # Characters the bitmap font lacks are shown as "?" (it covers printable Latin-1).
        text = text.strip().encode("latin-1", "replace").decode("latin-1")
        if not text:
            continue
        shown = f"[{text}]" if text.lower() in clickables else text
        lines += textwrap.wrap(shown, screen.cols, break_on_hyphens=False) or [""]
    if len(lines) > screen.rows:
        lines = [*lines[: screen.rows - 1], CUT_MARK]
    return lines


def draw_lines(lines: list[str], screen: Screen) -> np.ndarray:
    """The lines drawn black on white, row r at y = r * CELL_H: a uint8 array [height, width]."""
    image = Image.new("L", screen.size, 255)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default_imagefont()
    for row, line in enumerate(lines[: screen.rows]):
        draw.text((0, row * CELL_H), line, fill=0, font=font)
    return np.asarray(image, dtype=np.uint8)


class ScreenshotEnv:
    """The WebShop text env with a screenshot of each page in the pixel store (see the module docstring)."""

    def __init__(self, env: WebShopEnv, store: PixelStore, screen: Screen):
        self.env = env
        self.store = store
        self.screen = screen

    def reset(self, task_id: str) -> StepOutcome:
        return self._with_screenshot(self.env.reset(task_id))

    def step(self, action: str) -> StepOutcome:
        return self._with_screenshot(self.env.step(action))

    def close(self) -> None:
        self.env.close()

    def _with_screenshot(self, outcome: StepOutcome) -> StepOutcome:
        outcome.info["screenshot"] = self.store.put(screenshot(outcome, self.screen)[0])
        return outcome


def screenshot(outcome: StepOutcome, screen: Screen) -> tuple[np.ndarray, list[str]]:
    """The pixels of the outcome's page and the lines they show."""
    lines = page_lines(outcome.observation, outcome.admissible, screen)
    return draw_lines(lines, screen), lines


SCREEN_OPTIONS = {"screen_cols": Screen.cols, "screen_rows": Screen.rows, "screenshot_window": 1, "pixel_store": None}


class WebShopScreenshotSpec(WebShopSpec):
    """WebShop-1k shown as screenshots: WebShop's splits, actions, rewards, expert and prompt
    template, with the student's view of each page an image (see the module docstring).

    Options (beside WebShop's): `screen_cols`, `screen_rows` (the grid, default 96 x 48 cells,
    576 x 576 pixels), `screenshot_window` (k: the current page and the pages of the last k - 1
    turns are shown as screenshots, older turns by their actions alone, as WebGym keeps only the
    last rounds' screenshots), `pixel_store` (the store's folder; default a fresh folder on the
    node's shared memory, turnopd.core.pixels.default_pixel_root). The observation text stays in
    every outcome: a text teacher reads it, and the rollout engine puts the screenshots in its
    place in the student's prompt (envs.base.screenshot_view)."""

    name = "webshop_screenshot"
    observation_version = WebShopSpec.observation_version
    shows_screenshots = True  # envs.base.shows_screenshots: the rollout engine, SFT, start-up and the recipe check read it

    def __init__(self, config: Any, data_dir: str | None = None):
        options = dict(config.options)
        screen = {k: options.pop(k, default) for k, default in SCREEN_OPTIONS.items()}
        super().__init__(dataclasses.replace(config, options=options), data_dir)
        self.config = config
        for name in ("screen_cols", "screen_rows", "screenshot_window"):
            if not isinstance(screen[name], int) or screen[name] < 1:
                raise ValueError(f"webshop_screenshot option {name} must be a positive integer, got {screen[name]!r}")
        if screen["screenshot_window"] - 1 > config.history_length:
            raise ValueError(f"webshop_screenshot option screenshot_window ({screen['screenshot_window']}) shows the pages "
                             f"of the last {screen['screenshot_window'] - 1} turns, but env.history_length "
                             f"({config.history_length}) keeps only {config.history_length} turns in the prompt")
        self.screen = Screen(screen["screen_cols"], screen["screen_rows"])
        self.screenshot_window = screen["screenshot_window"]
        self.pixel_store = PixelStore(screen["pixel_store"] or default_pixel_root(f"{os.getpid()}-{uuid.uuid4().hex[:8]}"))

    def make(self) -> ScreenshotEnv:
        return ScreenshotEnv(super().make(), self.pixel_store, self.screen)

    def put_screenshot(self, observation: str, admissible: list[str] | None) -> str:
        """The page's screenshot put into the pixel store (a page of a cached demonstration), its key."""
        return self.pixel_store.put(screenshot(StepOutcome(observation, admissible=admissible), self.screen)[0])
