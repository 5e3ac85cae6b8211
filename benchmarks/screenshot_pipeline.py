"""Screenshots against text on WebShop, side by side in one run: what the pixel store saves in bytes
and pipe time, and what reading pixels costs in rollout and training throughput.

    python benchmarks/screenshot_pipeline.py                  # 3 repeats, 8 episodes of up to 4 turns
    python benchmarks/screenshot_pipeline.py --episodes 8 --turns 4 --repeats 3

Per repeat, on the same test tasks and sampling seeds:
- rollout: episode-turns per second of the text teacher of recipes/webshop/screenshot.yaml playing
  `webshop` (its prompts carry the pages' text) and of the VLM student playing `webshop_screenshot`
  (a screenshot per turn, through the pixel store), both through the env pool with 2 workers, the
  transformers policy, temperature 1; the two models share their language model's shape (hidden 128,
  3 layers), the VLM adds its vision tower and 576 image positions a prompt;
- train: one trainer step (k1) on each's trajectories, seconds per trained turn;
- bytes and pipe time per turn: a multiprocessing pipe (the env pool's and the generator's transport)
  sending a turn's screenshot key (what the trajectories carry), its uint8 screen (what an env worker
  would send without the store) and its float32 pixel_values (what a trajectory carrying the model's
  input would send to the trainer).
Medians of the repeats with their range, ratios paired per repeat; saved to
benchmarks/results/screenshot_pipeline.json (docs/screenshots.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from pathlib import Path

from record import MIN_REPEATS, Summary, save_result

from envs import make_env_spec
from envs.pool import EnvPool
from turnopd.config import EnvConfig, LossConfig, ObjectiveConfig, PolicyConfig, TrainerConfig
from turnopd.core.pixels import KEY_CHARS
from turnopd.core.types import build_token_batch
from turnopd.loaders.hf_models import load_model
from turnopd.loaders.screens import attach_screens
from turnopd.models import vlm
from turnopd.rollout import SamplingParams, make_policy
from turnopd.rollout.agent_loop import rollout
from turnopd.trainer import Trainer

MODELS = Path("~/.cache/turnopd/models").expanduser()
TEXT_MODEL = Path("runs/teachers/webshop/screenshot-teacher")
VLM = MODELS / "webshop-screenshot-student-sft100"


def play(env: str, model: Path, tasks: int, turns: int, seed: int) -> tuple[list, float, object]:
    config = EnvConfig(name=env, eval_split="test", max_turns=turns, history_length=1, answer_format="action",
                       num_workers=2)
    spec = make_env_spec(config)
    policy = make_policy(PolicyConfig(backend="transformers", max_new_tokens=48), str(model), dtype="float32", seed=seed)
    attach_screens(spec, model, policy)
    with EnvPool.for_config(spec, config) as pool:
        start = time.perf_counter()
        trajectories = rollout(spec, pool, policy, spec.tasks("test")[:tasks], env_config=config,
                               sampling=SamplingParams(temperature=1.0, max_new_tokens=48, seed=seed))
        seconds = time.perf_counter() - start
    return trajectories, seconds, spec


def train_seconds(model_dir: Path, spec, trajectories: list) -> float:
    for traj in trajectories:  # the teacher's scores stand in: the step's cost does not depend on them
        for turn in traj.turns:
            turn.teacher_logprobs = [lp - 0.1 for lp in turn.student_logprobs]
    model, _ = load_model(model_dir, "float32")
    trainer = Trainer(model.train(), TrainerConfig(lr=1e-4, micro_batch_tokens=16384), ObjectiveConfig(estimator="k1"),
                      LossConfig(mode="token_mean"), total_steps=1)
    attach_screens(spec, model_dir, trainer)
    start = time.perf_counter()
    trainer.step(build_token_batch(trajectories), alpha=0.0)
    return time.perf_counter() - start


def _echo(conn) -> None:
    while (message := conn.recv()) is not None:
        conn.send(len(message) if isinstance(message, bytes) else 0)


def pipe_seconds(payloads: list, repeats: int = 20) -> float:
    """Seconds to send each payload through a pipe to another process and hear back, per payload."""
    parent, child = mp.Pipe()
    worker = mp.get_context("fork").Process(target=_echo, args=(child,))
    worker.start()
    start = time.perf_counter()
    for _ in range(repeats):
        for payload in payloads:
            parent.send(payload)
            parent.recv()
    seconds = (time.perf_counter() - start) / (repeats * len(payloads))
    parent.send(None)
    worker.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    args = parser.parse_args()
    for model in (TEXT_MODEL, VLM):  # both built by the screenshot recipe's first run
        if not (model / "config.json").is_file():
            parser.error(f"{model} is not built: `turnopd distill recipes/webshop/screenshot.yaml trainer.steps=2` "
                         "builds the text teacher and the VLM student first (docs/screenshots.md)")
    samples = []
    for repeat in range(args.repeats):
        text, text_s, text_spec = play("webshop", TEXT_MODEL, args.episodes, args.turns, seed=repeat)
        shots, shots_s, shots_spec = play("webshop_screenshot", VLM, args.episodes, args.turns, seed=repeat)
        turns = {"text": sum(t.depth for t in text), "screenshots": sum(t.depth for t in shots)}
        keys = [turn.image_keys[0] for traj in shots for turn in traj.turns]
        screens = [shots_spec.pixel_store.get([key])[key] for key in keys[:8]]
        pixel_values = vlm.screen_pixel_values(screens[:1], VLM).numpy()
        sample = {
            "turns": turns, "prompt_tokens": {
                "text": sum(len(t.prompt_ids) for traj in text for t in traj.turns) / turns["text"],
                "screenshots": sum(len(t.prompt_ids) for traj in shots for t in traj.turns) / turns["screenshots"]},
            "rollout_turns_per_s": {"text": turns["text"] / text_s, "screenshots": turns["screenshots"] / shots_s},
            "train_s_per_turn": {"text": train_seconds(TEXT_MODEL, text_spec, text) / turns["text"],
                                 "screenshots": train_seconds(VLM, shots_spec, shots) / turns["screenshots"]},
            "bytes_per_turn": {"key": KEY_CHARS, "screen": int(screens[0].nbytes), "pixel_values": int(pixel_values.nbytes)},
            "pipe_ms_per_turn": {"key": 1e3 * pipe_seconds(keys[:8]), "screen": 1e3 * pipe_seconds(screens),
                                 "pixel_values": 1e3 * pipe_seconds([pixel_values] * 4, repeats=5)},
        }
        shots_spec.pixel_store.clear()
        samples.append(sample)
        print(f"repeat {repeat + 1}/{args.repeats}: {sample}", flush=True)

    def values(field: str, key: str) -> list[float]:
        return [s[field][key] for s in samples]

    summaries = [
        Summary.of("rollout episode-turns/s, text (tiny Llama)", values("rollout_turns_per_s", "text"), "turns/s"),
        Summary.of("rollout episode-turns/s, screenshots (tiny VLM)", values("rollout_turns_per_s", "screenshots"), "turns/s"),
        Summary.of("rollout throughput, screenshots / text", [s["rollout_turns_per_s"]["screenshots"] / s[
            "rollout_turns_per_s"]["text"] for s in samples], "x"),
        Summary.of("train seconds per turn, text", values("train_s_per_turn", "text"), "s"),
        Summary.of("train seconds per turn, screenshots", values("train_s_per_turn", "screenshots"), "s"),
        Summary.of("train time per turn, screenshots / text", [s["train_s_per_turn"]["screenshots"] / s[
            "train_s_per_turn"]["text"] for s in samples], "x"),
        Summary.of("pipe ms per turn, key", values("pipe_ms_per_turn", "key"), "ms"),
        Summary.of("pipe ms per turn, uint8 screen", values("pipe_ms_per_turn", "screen"), "ms"),
        Summary.of("pipe ms per turn, float32 pixel_values", values("pipe_ms_per_turn", "pixel_values"), "ms"),
    ]
    save_result("screenshot_pipeline", f"WebShop screenshots against text: {args.episodes} episodes of up to "
                f"{args.turns} turns, pixel store keys against pixels", summaries, samples,
                notes=f"bytes per turn: key {KEY_CHARS}, uint8 screen {samples[0]['bytes_per_turn']['screen']}, "
                      f"pixel_values {samples[0]['bytes_per_turn']['pixel_values']}")


if __name__ == "__main__":
    main()
