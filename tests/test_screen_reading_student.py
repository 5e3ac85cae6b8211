"""A text student that sees WebShop's screenshots through a screen reader (student.screen_reader,
turnopd.rollout.render.ReadScreenView): its prompt holds the text read off each page the window shows,
the teacher's the env's own text; the recipe's refusals; slow, with a real reader built small: a
rollout whose prompts are what the reader reads, and `turnopd distill` of such a student."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from envs import make_env_spec
from envs.base import PromptContext
from envs.pool import EnvPool
from tests.conftest import child_env
from tests.test_screenshots import RECIPE as SCREENSHOT_RECIPE
from turnopd.config import EnvConfig, PolicyConfig, RecipeError
from turnopd.core.pixels import default_pixel_root
from turnopd.loaders.screens import attach_screens
from turnopd.models import prepare_model, vlm
from turnopd.models.screen_reader import load_screen_reader
from turnopd.models.tiny import build_tiny_model
from turnopd.orchestration.recipe import load_recipe
from turnopd.orchestration.sft import load_sft_recipe
from turnopd.rollout import SamplingParams, make_policy
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.render import ReadScreenView, renderer_for

ENV = {"name": "webshop_screenshot", "eval_split": "test", "max_turns": 2, "history_length": 1,
       "answer_format": "action", "num_workers": 1}


class LabelReader:
    """A stand-in for the reader (the real one: the slow tests below): a screen filled with value v
    reads "READ-v"; it counts the screens it was given."""

    def __init__(self):
        self.screens = 0

    def read(self, screens):
        self.screens += len(screens)
        return [f"READ-{int(screen[0, 0])}" for screen in screens]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("tok") / "m", [p.text for p in vlm.play_pages("train", 2)],
                              hidden_size=64, num_layers=1, num_heads=1, vocab_size=1024)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("window, shown", [(1, ["READ-2"]), (2, ["READ-1", "READ-2"])])
def test_the_student_reads_the_window_s_pages_and_the_teacher_gets_their_text(tmp_path, tokenizer, window, shown):
    spec = make_env_spec(EnvConfig(**{**ENV, "options": {"pixel_store": str(tmp_path), "screenshot_window": window}}))
    keys = [spec.pixel_store.put(np.full((576, 576), value, dtype=np.uint8)) for value in (1, 2)]
    ctx = PromptContext(task="a red shirt", step=1, observation="OBS-NOW [SEP] Buy Now",
                        history=[("OBS-BEFORE [SEP] Search", "search[red shirt]")], admissible=["click[buy now]"],
                        answer_format="action")
    reader = LabelReader()
    view = renderer_for(spec, tokenizer, screen_reader=reader)
    assert isinstance(view, ReadScreenView)
    prompt = view.render(ctx, [{"screenshot": key} for key in keys], [])
    student, teacher = tokenizer.decode(prompt.ids), tokenizer.decode(prompt.teacher_ids)
    assert all(text in student for text in shown) and "OBS" not in student  # the env's text never reaches it
    assert "READ-1" not in student if window == 1 else "search[red shirt]" in student  # an older page: its action
    assert "OBS-NOW" in teacher and "OBS-BEFORE" in teacher and "READ" not in teacher
    assert prompt.image_keys == [] and reader.screens == window
    view.render(ctx, [{"screenshot": key} for key in keys], [])
    assert reader.screens == window  # each page read once


@pytest.mark.parametrize("recipe, overrides, refused", [
    ("recipes/quickstart.yaml", ["student.screen_reader=/r"], "'student.screen_reader': /r with env 'alfworld'"),
    ("recipes/webshop/screenshot.yaml", ["student.screen_reader=/r", "objective.tokenizers=cross"], "another tokenizer"),
    ("recipes/webshop/screenshot.yaml", ["policy.backend=vllm"], "only the transformers policy takes images"),
])
def test_the_recipe_check_refuses_a_reader_where_it_cannot_read(recipe, overrides, refused):
    with pytest.raises(RecipeError, match=refused):
        load_recipe(recipe, overrides)


def test_a_reading_student_may_generate_with_vllm_and_an_sft_model_reads_only_screenshots():
    cfg = load_recipe("recipes/webshop/screenshot.yaml", ["student.screen_reader=/r", "policy.backend=vllm"])
    assert cfg.student.screen_reader == "/r"  # text in, text out: any backend
    with pytest.raises(RecipeError, match="'model.screen_reader': /r with env 'webshop'"):
        load_sft_recipe("recipes/webshop/teacher_sft.yaml", ["model.screen_reader=/r"])


# ---- with a real reader, built small ------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A small screen reader (40 steps on 20 episodes' pages), a tiny text student and a tiny text
    teacher on one tokenizer, in one folder."""
    root = tmp_path_factory.mktemp("reading")
    prepare_model("screen_reader", root / "reader", episodes=20, eval_episodes=4, steps=40)
    texts = [p.text for p in vlm.play_pages("train", 2)]
    build_tiny_model(root / "student", texts, hidden_size=64, num_layers=1, num_heads=1, vocab_size=1024,
                     max_position_embeddings=2048, seed=0)
    build_tiny_model(root / "teacher", tokenizer=root / "student", hidden_size=64, num_layers=1, num_heads=1,
                     max_position_embeddings=2048, seed=3)
    (root / "teacher.yaml").write_text(f"name: text-teacher\nmodel: {root / 'teacher'}\nbackend: transformers\n"
                                       "dtype: float32\nmax_length: 2048\n")
    return root


@pytest.mark.slow
def test_a_rollout_shows_the_student_what_the_reader_reads(models, tmp_path):
    spec = make_env_spec(EnvConfig(**{**ENV, "options": {"pixel_store": str(tmp_path)}}))
    policy = make_policy(PolicyConfig(backend="transformers", max_new_tokens=8), str(models / "student"),
                         dtype="float32", seed=0)
    reader = load_screen_reader(models / "reader")
    screens = attach_screens(spec, models / "student", policy, reader=reader)
    assert policy.screen_reader is reader and screens is not None and screens.processor is None
    config = EnvConfig(**ENV)
    with EnvPool.for_config(spec, config) as pool:
        (traj,) = rollout(spec, pool, policy, spec.tasks("test")[:1], env_config=config,
                          sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
    first = traj.turns[0]
    student, teacher = policy.tokenizer.decode(first.prompt_ids), policy.tokenizer.decode(first.teacher_prompt_ids)
    assert first.image_keys == [] and "'Search'" in teacher  # the search page's text: the teacher's
    assert "'Search'" not in student and "WebShop" in student  # the student's: the page as read, line by line
    assert student != teacher


@pytest.mark.slow
def test_distill_a_student_that_reads_the_screens(models):
    """`turnopd distill` 3 steps with student.screen_reader: the run ends, its prompts hold no image,
    and the store is freed after every step."""
    recipe = models / "recipe.yaml"  # the VLM student's end-to-end recipe, with this text student and its reader
    recipe.write_text(SCREENSHOT_RECIPE.format(root=models).replace("name: shots", "name: reads").replace(
        f"student: {{path: {models}/student}}", f"student: {{path: {models}/student, screen_reader: {models}/reader}}"))
    done = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(recipe)], env=child_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (models / "runs" / "reads" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["screenshots"]["keys"] == 0 and r["screenshots"]["fetched_images"] == 0 for r in steps)
    assert all(r["screenshots"]["store_bytes"] > 0 for r in steps)  # the pages it read, until freed
    base = default_pixel_root("x").parent
    assert not [p for p in (base.iterdir() if base.exists() else []) if p.name.startswith("reads-")]  # emptied
