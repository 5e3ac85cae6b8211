"""The screen reader (turnopd.models.screen_reader): its codes go back to the cells they read in
either screen layout, the text it reads is the page's lines as drawn, the folder loads back to the
same reader, and a small one built by its preparation reads held-out pages and not another page's
screen (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from turnopd.models import vlm
from turnopd.models.base import prepare_model
from turnopd.models.screen_reader import (
    load_screen_reader,
    new_screen_reader,
    save_screen_reader,
    screen_cells,
    screen_text,
    text_reading,
)

PAGE = vlm.PageShot(None, "WebShop\n\n[Buy Now]   \nprice: $12.99")  # a blank line inside, trailing blanks on a line


@pytest.mark.parametrize("layout", ["grid", "row_tiles"])
def test_codes_go_back_to_the_cells_they_read(layout):
    """The labels of a page, laid out as the tower sees them (vlm.cell_labels), put back by
    screen_cells: the page's lines, each right-stripped, no blank rows after the last."""
    reader = new_screen_reader(hidden_size=64, screen_layout=layout)
    codes = vlm.cell_labels([PAGE], reader.processor)[0]  # what a reader that reads every cell right outputs
    assert screen_text(codes, screen_cells(reader.processor)) == "WebShop\n\n[Buy Now]\nprice: $12.99"
    if layout == "row_tiles":  # patch i holds characters 8i .. 8i + 7 of row 0 first: "WebShop " is patch 0
        assert bytes(codes[0].tolist()) == b"WebShop "
        assert screen_cells(reader.processor)[1].tolist() == list(range(8, 16))


def test_text_reading_by_hand():
    # 1 edit over 6 characters (two of them newlines) -> 5/6; lines: "a" right, "bc" read "bx", "d" right -> 2 of 3
    assert text_reading("a\nbx\nd", "a\nbc\nd") == {"char_accuracy": pytest.approx(5 / 6), "lines_exact": pytest.approx(2 / 3)}
    assert text_reading("", "ab\ncd")["lines_exact"] == 0.0


def test_a_saved_reader_loads_back_and_reads_the_same(tmp_path):
    pages = vlm.play_pages("test", 1)
    reader = new_screen_reader(hidden_size=64, seed=3)
    with torch.no_grad():
        reader.reader.linear.bias[ord("e")] += 5.0  # a non-default weight the load must bring back
    save_screen_reader(reader, tmp_path)
    loaded = load_screen_reader(tmp_path)
    assert loaded.processor.patch_size == 24
    assert getattr(loaded.processor.image_processor, "screen_layout", None) == "row_tiles"
    screens = [p.pixels for p in pages[:2]]
    assert loaded.read(screens) == reader.read(screens)
    assert "e" in loaded.read(screens)[0]


@pytest.mark.slow
def test_a_small_reader_reads_held_out_pages_and_not_another_page_s_screen(tmp_path):
    """prepare_model("screen_reader") at a small size: 40 steps of 4 pages over the distinct pages of
    20 train episodes; its build record's reading test on the held-out pages of 8 test episodes (none a
    train page): text cells read far above chance from their own screens, near chance from another
    page's. ~1.5 min on 2 cores."""
    folder = prepare_model("screen_reader", tmp_path / "reader", episodes=20, eval_episodes=8, steps=40)
    reading = json.loads((folder / "turnopd_build.json").read_text())["reading"]
    assert reading["held_out_pages"] >= 8 and reading["last_loss"] < reading["first_loss"] / 2
    assert reading["cell_accuracy_swapped"] < 0.1, reading
    assert reading["cell_accuracy"] > reading["cell_accuracy_swapped"] + 0.4, reading
    reader = load_screen_reader(folder)
    assert reader.read([vlm.play_pages("test", 1)[0].pixels])[0].startswith("WebShop")
