"""WebShop as screenshots: the page layout and pixels (hand-worked), the same outcomes as the text
env on the same actions, the screenshots in the pixel store, the student's view of a turn, and bad
options."""

from __future__ import annotations

import numpy as np
import pytest

from envs import make_env_spec
from envs.base import HIDDEN_PAGE, IMAGE_PLACEHOLDER, PromptContext, screenshot_view
from envs.webshop.screenshot import CELL_H, CELL_W, CUT_MARK, Screen, draw_lines, page_lines, screenshot
from turnopd.config import EnvConfig


def config(name: str, **options) -> EnvConfig:
    return EnvConfig(name=name, eval_split="test", max_turns=15, options=options)


@pytest.fixture
def shot_spec(tmp_path):
    spec = make_env_spec(config("webshop_screenshot", pixel_store=str(tmp_path / "pixels")))
    yield spec
    spec.pixel_store.clear()


def test_page_lines_bracket_clickables_wrap_and_cut():
    observation = "Instruction: [SEP] a b c d e f [SEP] Buy Now [SEP]   [SEP] caf\u00e9 \u2603"
    admissible = ["click[buy now]"]
    # 5 columns: "a b c d e f" wraps at word boundaries into "a b c", "d e f"; the button is bracketed and
    # wraps too ("[Buy" / "Now]"); the blank text is skipped; the snowman is not Latin-1: "?"
    assert page_lines(observation, admissible, Screen(cols=5, rows=20)) == [
        "Instr", "uctio", "n:", "a b c", "d e f", "[Buy", "Now]", "caf\u00e9", "?"]
    # 4 rows: the first 3 lines and the cut mark
    assert page_lines(observation, admissible, Screen(cols=5, rows=4)) == ["Instr", "uctio", "n:", CUT_MARK]
    # the search page's button: clickable where the page has a search bar (WebShop does not list it)
    assert page_lines("WebShop [SEP] Search", ["search[<your query>]"], Screen()) == ["WebShop", "[Search]"]
    assert page_lines("WebShop [SEP] Search", [], Screen()) == ["WebShop", "Search"]


def test_pixels_are_glyphs_on_a_grid():
    screen = Screen(cols=4, rows=3)
    assert screen.size == (4 * CELL_W, 3 * CELL_H) == (24, 36)
    blank = draw_lines([], screen)
    assert blank.shape == (36, 24) and blank.dtype == np.uint8 and (blank == 255).all()
    one = draw_lines(["a"], screen)
    shifted = draw_lines(["", " a"], screen)  # the same glyph one row down and one column right
    glyph = one[:CELL_H, :CELL_W]
    assert (glyph < 128).any()  # ink in its cell
    assert (one[:, CELL_W:] == 255).all() and (one[CELL_H:, :] == 255).all()  # none outside it
    assert np.array_equal(shifted[CELL_H : 2 * CELL_H, CELL_W : 2 * CELL_W], glyph)
    assert not np.array_equal(draw_lines(["b"], screen)[:CELL_H, :CELL_W], glyph)


def test_same_outcomes_as_the_text_env_and_screenshots_in_the_store(shot_spec):
    text_spec = make_env_spec(config("webshop"))
    text_env, shot_env = text_spec.make(), shot_spec.make()
    keys = []
    for task in text_spec.tasks("test")[:4]:
        expert = text_spec.expert(task)
        text_out, shot_out = text_env.reset(task), shot_env.reset(task)
        for _ in range(15):
            key = shot_out.info.pop("screenshot")
            keys.append(key)
            assert (shot_out.observation, shot_out.reward, shot_out.done, shot_out.won, shot_out.admissible,
                    shot_out.info) == (text_out.observation, text_out.reward, text_out.done, text_out.won,
                                       text_out.admissible, text_out.info)
            pixels, lines = screenshot(shot_out, shot_spec.screen)
            # the env's own page (its texts and clickables, not the outcome's): each text, bracketed where
            # clickable, in order, wrapped at single spaces (the whole page where it fits the screen)
            page = shot_env.env.page
            shown = [f"[{t.strip()}]" if t.strip().lower() in page.clickables else t.strip() for t in page.texts
                     if t.strip()]
            if CUT_MARK not in lines:
                assert " ".join(lines) == " ".join(shown).encode("latin-1", "replace").decode("latin-1")
            assert shot_spec.put_screenshot(shot_out.observation, shot_out.admissible) == key
            stored = shot_spec.pixel_store.get([key])[key]
            assert np.array_equal(stored, pixels) and stored.shape == (576, 576) and stored.dtype == np.uint8
            assert key == shot_spec.pixel_store.key_of(pixels)
            if text_out.done:
                break
            action = expert.act(text_out)
            text_out, shot_out = text_env.step(action), shot_env.step(action)
        assert text_out.done and shot_out.reward == text_out.reward
    # every search page of a task is the same picture: one key, stored once
    assert len(set(keys)) < len(keys)
    assert shot_spec.pixel_store.stats()["stored"] == len(set(keys))


def test_screenshot_view_hand_worked():
    ctx = PromptContext(task="t", step=3, observation="page 3", history=[("page 0", "a0"), ("page 1", "a1"),
                                                                         ("page 2", "a2")])
    view, keys = screenshot_view(ctx, ["k0", "k1", "k2", "k3"], window=2)
    assert view.observation == IMAGE_PLACEHOLDER and view.task == "t" and view.step == 3
    assert view.history == [(HIDDEN_PAGE, "a0"), (HIDDEN_PAGE, "a1"), (IMAGE_PLACEHOLDER, "a2")]
    assert keys == ["k2", "k3"]
    view, keys = screenshot_view(ctx, ["k0", "k1", "k2", "k3"], window=1)
    assert [page for page, _ in view.history] == [HIDDEN_PAGE] * 3 and keys == ["k3"]
    view, keys = screenshot_view(PromptContext(task="t", step=0, observation="p", history=[]), ["k"], window=3)
    assert view.history == [] and keys == ["k"]
    with pytest.raises(ValueError, match="a key per history page"):
        screenshot_view(ctx, ["k3"], window=1)


def test_the_student_prompt_shows_placeholders_not_page_text(shot_spec):
    env = shot_spec.make()
    outcome = env.reset(shot_spec.tasks("test")[0])
    ctx = PromptContext(task=outcome.info["task"], step=0, observation=outcome.observation, history=[],
                        admissible=outcome.admissible, answer_format="action")
    view, keys = screenshot_view(ctx, [outcome.info["screenshot"]], shot_spec.screenshot_window)
    prompt = shot_spec.render_prompt(view)
    assert prompt.count(IMAGE_PLACEHOLDER) == len(keys) == 1
    # the search page's text after the goal is its "Search" button: in the text view (a text teacher's) only
    assert "'Search'" not in prompt and f"'{IMAGE_PLACEHOLDER}'" in prompt
    assert "'Search'" in shot_spec.render_prompt(ctx)


@pytest.mark.parametrize("options, message", [
    ({"screenshot_window": 4}, "history_length"),
    ({"screen_cols": 0}, "screen_cols must be a positive integer"),
    ({"screen_rows": "many"}, "screen_rows must be a positive integer"),
    ({"resolution": 2}, "unknown webshop options"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        make_env_spec(config("webshop_screenshot", **options))
