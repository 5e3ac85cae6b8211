"""The datasets of the autoresearch env, made on the spot from what installed packages ship: no
download, no data folder. scikit-learn (whose digits, wine and iris would be the obvious choice) is
not a dependency of the project, so the image datasets render the glyphs of the fonts that matplotlib
(a dependency) ships, and `spirals` is drawn from numpy's seeded generator.

- `digits`: the digits 0-9, `letters`: the capitals A-Z, each drawn from one of FONTS at a random
  scale, rotation and shift with pixel noise, as 12x12 grey images (144 features in [0, 1]).
- `spirals`: three interleaved noisy spiral arms in the plane (2 features), the classic problem a
  small MLP only solves when its learning rate, width and depth are right.

Each dataset is a fixed draw (seed DATA_SEED), split into training and validation examples.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from functools import cache

import numpy as np

DATA_SEED = 0
SIDE = 12  # image side in pixels
# Upright and slanted, sans, serif and monospace faces, regular and bold (all in matplotlib's mpl-data)
FONTS = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSerif.ttf",
    "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf",
    "STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "cmr10.ttf", "cmss10.ttf", "cmtt10.ttf",
)


@dataclass(frozen=True)
class Dataset:
    name: str
    classes: int
    x_train: np.ndarray  # float32, (n, features)
    y_train: np.ndarray  # int64, (n,)
    x_val: np.ndarray
    y_val: np.ndarray

    @property
    def features(self) -> int:
        return self.x_train.shape[1]

    def describe(self) -> str:
        """One line for the task text: what the data is and how much of it there is."""
        return (f"{DESCRIPTIONS[self.name]}: {self.classes} classes, {self.features} features, "
                f"{len(self.y_train):,} training and {len(self.y_val):,} validation examples")


DESCRIPTIONS = {
    "digits": "digits 0-9 rendered from 14 fonts as noisy 12x12 images",
    "letters": "capital letters A-Z rendered from 14 fonts as noisy 12x12 images",
    "spirals": "three interleaved noisy spiral arms in the plane",
}
DATASETS = tuple(DESCRIPTIONS)


def _glyph(font_file: str, char: str) -> np.ndarray:
    """The glyph of `char` in a font at 48 px, as a float array in [0, 1] (ink = 1), unhinted so that
    the shape does not depend on FreeType's hinting settings."""
    import matplotlib
    from matplotlib.ft2font import FT2Font, LoadFlags

    font = FT2Font(f"{matplotlib.get_data_path()}/fonts/ttf/{font_file}")
    font.set_size(48, 72)
    font.set_text(char, 0.0, flags=LoadFlags.NO_HINTING)
    font.draw_glyphs_to_bitmap(antialiased=True)
    return np.asarray(font.get_image(), dtype=np.float32) / 255.0


def _place(glyph: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The glyph on a SIDE x SIDE grid under a random similarity transform (scale 0.75-1.05 of the
    grid, rotation within +-15 degrees, shift within +-1.5 px), sampled at pixel centres (nearest
    neighbour), plus Gaussian noise (sd 0.1), clipped to [0, 1]."""
    h, w = glyph.shape
    scale = rng.uniform(0.75, 1.05) * SIDE / max(h, w)  # grid pixels per glyph pixel
    angle = np.deg2rad(rng.uniform(-15, 15))
    shift = rng.uniform(-1.5, 1.5, size=2)
    centre = (SIDE - 1) / 2 + shift
    ys, xs = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64)
    dy, dx = ys - centre[0], xs - centre[1]
    # grid -> glyph coordinates: undo the rotation, then the scale
    gy = (np.cos(angle) * dy + np.sin(angle) * dx) / scale + (h - 1) / 2
    gx = (-np.sin(angle) * dy + np.cos(angle) * dx) / scale + (w - 1) / 2
    iy, ix = np.rint(gy).astype(int), np.rint(gx).astype(int)
    inside = (iy >= 0) & (iy < h) & (ix >= 0) & (ix < w)
    image = np.where(inside, glyph[iy.clip(0, h - 1), ix.clip(0, w - 1)], 0.0)
    return np.clip(image + rng.normal(0.0, 0.1, size=image.shape), 0.0, 1.0)


def _glyph_images(chars: str, per_class: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    glyphs = {(font, char): _glyph(font, char) for font in FONTS for char in chars}
    x, y = [], []
    for _ in range(per_class):
        for label, char in enumerate(chars):
            font = FONTS[rng.integers(len(FONTS))]
            x.append(_place(glyphs[font, char], rng).reshape(-1))
            y.append(label)
    return np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64)


def _spirals(per_class: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Three arms of 1.5 turns each, 120 degrees apart, radius 0.1-1 along the arm, with Gaussian
    noise (sd 0.06) on both coordinates."""
    arms = []
    for arm in range(3):
        t = rng.uniform(0.1, 1.0, size=per_class)
        theta = 3 * np.pi * t + arm * 2 * np.pi / 3
        arms.append(np.stack([t * np.cos(theta), t * np.sin(theta)], axis=1) + rng.normal(0, 0.06, (per_class, 2)))
    # interleaved by class (arm 0, 1, 2, 0, 1, 2, ...), as the glyph datasets are
    x = np.stack(arms, axis=1).reshape(-1, 2)
    return x.astype(np.float32), np.tile(np.arange(3), per_class).astype(np.int64)


# examples per class, training and validation
SIZES = {"digits": (100, 40), "letters": (60, 24), "spirals": (200, 100)}


@cache
def load_dataset(name: str) -> Dataset:
    """Dataset `name` (one of DATASETS), made once per process (~0.1-0.5 s)."""
    if name not in SIZES:
        raise ValueError(f"unknown autoresearch dataset {name!r}; known: {', '.join(DATASETS)}")
    rng = np.random.default_rng([DATA_SEED, DATASETS.index(name)])
    train, val = SIZES[name]
    if name == "spirals":
        x, y = _spirals(train + val, rng)
        classes = 3
    else:
        chars = string.digits if name == "digits" else string.ascii_uppercase
        x, y = _glyph_images(chars, train + val, rng)
        classes = len(chars)
    cut = train * classes  # the examples are interleaved by class, so both parts are balanced
    return Dataset(name, classes, x[:cut], y[:cut], x[cut:], y[cut:])
