"""A vision-language student on WebShop's screenshots, end to end with real parts: the
webshop_screenshot env in the env pool, a tiny LLaVA (turnopd.models.vlm) generating from the pixel
store's screenshots, a text teacher's prompts, the trainer's forward with the pixels, a batch dropped
for a lost screenshot, the recipe's refusals; slow: `turnopd distill` on it, killed and resumed."""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from envs import make_env_spec
from envs.base import IMAGE_PLACEHOLDER
from envs.pool import EnvPool
from envs.webshop.screenshot import CELL_H, Screen, draw_lines
from teachers.scoring import score_trajectories
from tests.conftest import child_env
from turnopd.config import EnvConfig, LossConfig, ObjectiveConfig, PolicyConfig, RecipeError, TrainerConfig
from turnopd.core.pixels import KEY_CHARS
from turnopd.core.text import expand_placeholders
from turnopd.core.types import build_token_batch
from turnopd.loaders.screens import attach_screens
from turnopd.models import vlm
from turnopd.models.tiny import build_tiny_model
from turnopd.orchestration.recipe import load_recipe
from turnopd.rollout import SamplingParams, make_policy
from turnopd.rollout.agent_loop import rollout
from turnopd.trainer import Trainer

SIZE = {"hidden_size": 64, "num_layers": 1, "num_heads": 1, "max_position_embeddings": 2048,
        "vision_hidden_size": 32, "vision_layers": 1, "vision_heads": 1, "vocab_size": 1024}
ENV = {"name": "webshop_screenshot", "eval_split": "test", "max_turns": 2, "history_length": 1,
       "answer_format": "action", "num_workers": 1}


def test_expand_placeholders_hand_worked():
    assert expand_placeholders([1, 7, 2, 7], placeholder=7, copies=3) == [1, 7, 7, 7, 2, 7, 7, 7]
    assert expand_placeholders([1, 2], placeholder=7, copies=3) == [1, 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A tiny VLM student and a tiny text teacher built on its tokenizer, in one folder."""
    root = tmp_path_factory.mktemp("screenshots")
    pages = vlm.play_pages("train", 2)
    vlm.build_tiny_vlm(root / "student", [p.text for p in pages], seed=0, **SIZE)
    build_tiny_model(root / "teacher", tokenizer=root / "student", hidden_size=64, num_layers=1, num_heads=1,
                     max_position_embeddings=2048, seed=3)
    (root / "teacher.yaml").write_text(f"name: text-teacher\nmodel: {root / 'teacher'}\nbackend: transformers\n"
                                       "dtype: float32\nmax_length: 2048\n")
    return root


@pytest.fixture(scope="module")
def played(models, tmp_path_factory):
    """2 episodes of 2 turns of the VLM on test tasks, screenshots in a store of their own."""
    spec = make_env_spec(EnvConfig(**{**ENV, "options": {"pixel_store": str(tmp_path_factory.mktemp("px"))}}))
    policy = make_policy(PolicyConfig(backend="transformers", max_new_tokens=8), str(models / "student"),
                         dtype="float32", seed=0)
    attach_screens(spec, models / "student", policy)
    config = EnvConfig(**ENV)
    with EnvPool.for_config(spec, config) as pool:
        trajectories = rollout(spec, pool, policy, spec.tasks("test")[:2], env_config=config,
                               sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=5))
    yield spec, policy, trajectories
    spec.pixel_store.clear()


def test_the_student_sees_screenshots_and_the_teacher_text(played):
    spec, policy, trajectories = played
    tokenizer, image_id = policy.tokenizer, policy.tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    per_screen = (576 // vlm.PATCH_SIZE) ** 2
    assert policy.image_tokens == per_screen == 576
    for traj in trajectories:
        assert traj.depth == 2
        for turn in traj.turns:
            assert len(turn.image_keys) == 1 and len(turn.image_keys[0]) == KEY_CHARS  # window 1: this page
            assert turn.prompt_ids.count(image_id) == per_screen
            assert image_id not in turn.teacher_prompt_ids
            goal = tokenizer.decode(turn.teacher_prompt_ids)
            assert traj.goal in goal and traj.goal in tokenizer.decode(turn.prompt_ids)  # the task line is text
        # turn 0 is the search page: "WebShop" on its first row, drawn as the renderer draws it
        first = spec.pixel_store.get(traj.turns[0].image_keys)[traj.turns[0].image_keys[0]]
        assert np.array_equal(first[:CELL_H], draw_lines(["WebShop"], Screen())[:CELL_H])
        # the page text the student does not get: the search button is in the teacher's prompt only
        assert "'Search'" in tokenizer.decode(traj.turns[0].teacher_prompt_ids)
        assert "'Search'" not in tokenizer.decode(traj.turns[0].prompt_ids)


def test_the_student_never_writes_its_image_token(played):
    """With the image token's logit raised by 1000 (a hook on the head), greedy decoding would write
    it at every position; the policy suppresses it (an image token in an answer would be taken for an
    image position by the trainer's forward)."""
    spec, policy, trajectories = played
    image_id = policy.model.config.image_token_id
    turn = trajectories[0].turns[0]

    def favour_image_token(module, inputs, logits):
        logits[..., image_id] += 1000.0
        return logits

    hook = policy.model.lm_head.register_forward_hook(favour_image_token)
    try:
        generation = asyncio.run(policy.generate(turn.prompt_ids, SamplingParams(temperature=0, max_new_tokens=4),
                                                 turn.image_keys))
    finally:
        hook.remove()
    assert len(generation.token_ids) == 4 and image_id not in generation.token_ids
    assert all(image_id not in t.action_ids for traj in trajectories for t in traj.turns)


def direct_logprobs(model, processor, prompt, action, screens) -> torch.Tensor:
    """The action tokens' log-probs by one plain forward of the VLM on prompt + action with the screens."""
    ids = torch.tensor([prompt + action])
    pixels = vlm.screen_pixel_values(screens, processor)
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(action) - 1)
    return logits[positions].log_softmax(-1)[torch.arange(len(action)), torch.tensor(action)]


def test_generation_log_probs_are_the_model_s_on_the_screenshots(played):
    spec, policy, trajectories = played
    turn = trajectories[0].turns[1]
    screens = [spec.pixel_store.get(turn.image_keys)[turn.image_keys[0]]]
    expected = direct_logprobs(policy.model, policy.screens.processor, turn.prompt_ids, turn.action_ids, screens)
    assert torch.allclose(torch.tensor(turn.student_logprobs), expected, atol=2e-4)
    # and they depend on the image: a blank screen gives others
    blank = direct_logprobs(policy.model, policy.screens.processor, turn.prompt_ids, turn.action_ids,
                            [np.full((576, 576), 255, np.uint8)])
    assert not torch.allclose(expected, blank, atol=1e-3)


def make_trainer(models: Path) -> Trainer:
    from turnopd.loaders.hf_models import load_model

    model, _ = load_model(models / "student", "float32")
    return Trainer(model.train(), TrainerConfig(lr=1e-3, micro_batch_tokens=4096), ObjectiveConfig(estimator="k1"),
                   LossConfig(mode="token_mean"), total_steps=2)


def test_the_trainer_reads_the_screenshots_and_drops_a_batch_that_lost_one(models, played):
    spec, _, trajectories = played
    # the text teacher scores each turn on its own prompt (a window per turn: history_length 1 re-renders)
    scored = score_trajectories({spec.name: make_teacher(models)}, trajectories)
    assert scored == sum(len(t.teacher_prompt_ids) + len(t.action_ids) for traj in trajectories for t in traj.turns)
    assert all(len(t.teacher_logprobs) == len(t.action_ids) for traj in trajectories for t in traj.turns)
    for traj in trajectories:  # a teacher 0.1 nats below the sampled tokens' log-probs: KL 0.1 at the start
        for turn in traj.turns:
            turn.teacher_logprobs = [lp - 0.1 for lp in turn.student_logprobs]
    trainer = make_trainer(models)
    screens = trainer.images = attach_screens(spec, models / "student")
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    lost = trajectories[1].turns[0].image_keys[0]
    pixels = spec.pixel_store.get([lost])[lost]
    spec.pixel_store.free([lost])
    dropped = trainer.step(build_token_batch(trajectories), alpha=0.0)
    assert dropped.dropped and dropped.missing_images == 1 and dropped.skipped
    assert all(torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())
    assert screens.counts.images == 0  # nothing fetched for a dropped batch
    assert spec.pixel_store.put(pixels) == lost  # back, for the tests after this one
    result = trainer.step(build_token_batch([trajectories[0]]), alpha=0.0)  # its screenshots are all there
    # the trainer's forward with the screenshots reproduces the rollout's log-probs: KL exactly 0.1
    assert not result.dropped and result.mean_kl == pytest.approx(0.1, abs=5e-4)
    assert screens.counts.images == 2  # one screenshot per turn, fetched for the forward
    assert any(not torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())


def make_teacher(models: Path, spec_file: str = "teacher.yaml"):
    from teachers import make_teachers
    from teachers.spec import load_teacher_spec

    return make_teachers({"webshop_screenshot": load_teacher_spec(models / spec_file)})["webshop_screenshot"]


def test_a_vision_language_teacher_scores_what_the_student_saw(models, played):
    """The student's own weights as a VLM teacher: it scores the student's prompts with their
    screenshots, so its log-probs are the ones the student sampled with (the images included)."""
    spec, _, trajectories = played
    (models / "vlm_teacher.yaml").write_text(f"name: vlm-teacher\nmodel: {models / 'student'}\n"
                                             "backend: transformers\ndtype: float32\nmax_length: 2048\n")
    teacher = make_teacher(models, "vlm_teacher.yaml")
    assert teacher.reads_screenshots and not make_teacher(models).reads_screenshots
    attach_screens(spec, models / "student", teacher)
    copies = copy.deepcopy(trajectories)
    scored = score_trajectories({spec.name: teacher}, copies)
    assert scored == sum(len(t.prompt_ids) + len(t.action_ids) for traj in copies for t in traj.turns)
    for traj in copies:
        for turn in traj.turns:
            assert torch.allclose(torch.tensor(turn.teacher_logprobs), torch.tensor(turn.student_logprobs), atol=2e-4)


@pytest.mark.parametrize("override, refused", [
    ("policy.backend=vllm", "only the transformers policy"),
    ("objective.estimator=full", "image tokens"),
])
def test_the_recipe_refuses_what_cannot_pass_screenshots(override, refused):
    with pytest.raises(RecipeError, match=refused):
        load_recipe("recipes/webshop/screenshot.yaml", override.split())


def test_each_rank_of_a_run_keeps_its_screenshots_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """A rank frees what its own episodes no longer hold; with one store for all ranks it would free
    another rank's pages still playing. One rank: the run's folder itself."""
    import turnopd.orchestration.startup as startup
    from turnopd.core.pixels import PixelStore

    cfg = load_recipe("recipes/webshop/screenshot.yaml", [f"env.options.pixel_store={tmp_path / 'px'}"])
    spec = type("Spec", (), {"shows_screenshots": True, "pixel_store": PixelStore(tmp_path / "px")})()
    stale = spec.pixel_store.put(np.zeros((12, 6), dtype=np.uint8))  # a killed run's page
    startup.run_pixel_store(cfg, spec, tmp_path / "run")
    assert spec.pixel_store.root == tmp_path / "px" and spec.pixel_store.missing([stale]) == [stale]
    monkeypatch.setattr(startup, "rank_and_world", lambda: (1, 2))
    startup.run_pixel_store(cfg, spec, tmp_path / "run")
    assert spec.pixel_store.root == tmp_path / "px" / "rank1"


RECIPE = """
name: shots
output_dir: {root}/runs
student: {{path: {root}/student}}
teachers: {{webshop_screenshot: {root}/teacher.yaml}}
env: {{name: webshop_screenshot, max_turns: 2, answer_format: action, history_length: 1, num_workers: 1,
       max_tasks: 4, eval_split: test}}
policy: {{max_new_tokens: 8}}
objective: {{estimator: k1}}
depth: {{warmup_steps: 1, probe_every: 2, num_probes: 2, min_successes: 1}}
trainer: {{steps: 3, episodes_per_step: 2, lr: 1.0e-3}}
eval: {{max_tasks: 1}}
checkpoint: {{every: 1, keep_last: 5}}
tracking: []
"""


@pytest.mark.slow
def test_distill_on_screenshots_killed_and_resumed(models):
    """`turnopd distill` with the VLM student: SIGKILL at step 2's optimizer step (its screenshots still
    in the store), then --resume: the resumed run frees the killed run's screenshots, plays step 2 again
    and finishes; every step's record counts its screenshots, none dropped, and the store is empty after."""
    (models / "recipe.yaml").write_text(RECIPE.format(root=models))
    run_dir = models / "runs" / "shots"

    def distill(*args: str, failpoint: str = "") -> subprocess.CompletedProcess:
        env = child_env(**({"TURNOPD_FAILPOINTS": failpoint} if failpoint else {}))
        return subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(models / "recipe.yaml"), *args],
                              env=env, capture_output=True, text=True, timeout=900)

    killed = distill(failpoint="trainer.optimizer_step@2=kill")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    stores = [p for p in vlm_store_roots() if p.name.startswith("shots-")]
    assert len(stores) == 1 and list(stores[0].glob("*.npy"))  # step 2's screenshots, left by the kill
    resumed = distill("--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert not stores[0].exists()  # freed: at the resume, then after every step
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        shots = record["screenshots"]
        turns = round(record["mean_turns"] * record["episodes"])
        assert shots["keys"] == turns > 0 and 0 < shots["stored"] <= shots["keys"]
        assert shots["key_bytes"] == KEY_CHARS * shots["keys"]
        assert shots["screen_bytes"] == 576 * 576 * shots["keys"]  # uint8 screens
        assert shots["pixel_value_bytes"] == 3 * 576 * 576 * 4 * shots["keys"]  # float32 RGB pixel_values
        # every turn's screenshot fetched once to generate it and once to train on it
        assert shots["fetched_images"] == 2 * shots["keys"]
        assert not shots["dropped"] and shots["missing"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "pool"])
def test_distill_on_screenshots_while_the_generator_plays(models, mode):
    """The asynchronous pipelines on screenshots: the generator process plays (and fetches its own
    screenshots) while steps train, and freeing between steps keeps what its episodes and the
    received trajectories hold: no batch loses an image, every trained turn's screenshot is fetched
    once by the trainer, and the store is empty after the run."""
    recipe, name = models / f"{mode}.yaml", f"async-{mode}"  # not "shots-": the other test's store prefix
    recipe.write_text(RECIPE.format(root=models))
    done = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(recipe), f"name={name}",
                           f"pipeline.mode={mode}", "objective.clip_eps=0.2", "checkpoint.every=0"],
                          env=child_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (models / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        shots = record["screenshots"]
        assert shots["keys"] == round(record["mean_turns"] * record["episodes"]) > 0
        assert shots["fetched_images"] == shots["keys"]  # training's; the generator fetched its own
        assert not shots["dropped"] and shots["missing"] == 0
    assert not [p for p in vlm_store_roots() if p.name.startswith(f"{name}-")]  # emptied at the end


def vlm_store_roots() -> list[Path]:
    from turnopd.core.pixels import default_pixel_root

    base = default_pixel_root("x").parent
    return sorted(base.iterdir()) if base.exists() else []
