"""prompt.style=chat against history_block on the same ALFWorld episodes: the tokens a forward pass
processes per env step, the time of a train step and its peak memory, at the quickstart's horizon
(40 turns) and at 50.

    python benchmarks/chat_context.py                 # 3 repeats, 2 episodes of each horizon

The episodes: the real ALFWorld engine played by a seeded random walk over the admissible actions
(a chance win ends one early; every figure is per env step), each answer `<action>ACTION</action>`.
Both styles render the same episodes with SmolLM2-135M-Instruct's tokenizer and ChatML template and
ALFWorld's `default` (verl-agent) template: history_block with the paper's history window of 2 pairs,
each turn its own sequence; chat, each episode one conversation (the turns' messages: the observation
and its admissible actions). The student and the in-process teacher (the `full` estimator, as in the
quickstart) run the same sequences, so "tokens per env step" is each one's forward pass. The train
step runs on a tiny random model with that tokenizer (2 layers, hidden 64: the cost of the context,
not of a model), in a fresh process per repeat: its time, and its peak memory above the process's
before it (ru_maxrss). Saved to benchmarks/results/chat_context.json.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import Summary, save_result

from envs import make_env_spec
from envs.base import PromptContext, recent_pairs
from turnopd.config import EnvConfig, PromptConfig

HORIZONS = (40, 50)  # the quickstart's max_turns, and 50
STYLES = ("history_block", "chat")
ENV = EnvConfig(name="alfworld", template="default", answer_format="action", history_length=2,
                task_types=["look_at_obj_in_light"])


def random_walks(episodes: int, turns: int, seed: int) -> list[dict]:
    """`episodes` train games played for `turns` steps by a seeded random walk over the admissible
    actions: per game its goal and each step's (observation, admissible actions, action)."""
    spec, rng = make_env_spec(ENV), random.Random(seed)
    walks = []
    for task in spec.tasks("train")[:episodes]:
        env = spec.make()
        outcome, steps = env.reset(task), []
        goal = outcome.info["task"]
        while len(steps) < turns and not outcome.done:
            action = rng.choice([a for a in outcome.admissible if a != "help"])
            steps.append((outcome.observation, outcome.admissible, action))
            outcome = env.step(action)
        env.close()
        walks.append({"goal": goal, "steps": steps})
    return walks


def trajectories(walks: list[dict], style: str, tokenizer) -> list:
    """The walks as trajectories the engine's renderer of `style` renders."""
    from turnopd.core.types import Trajectory, Turn
    from turnopd.rollout.render import renderer_for

    spec = make_env_spec(ENV)
    renderer = renderer_for(spec, tokenizer, prompt=PromptConfig(style=style))
    out = []
    for i, walk in enumerate(walks):
        turns, history = [], []
        for step, (observation, admissible, action) in enumerate(walk["steps"]):
            ctx = PromptContext(task=walk["goal"], step=step, observation=observation,
                                history=recent_pairs(history, ENV.history_length), admissible=admissible,
                                answer_format=ENV.answer_format)
            ids = tokenizer.encode(f"<action>{action}</action>", add_special_tokens=False)
            turns.append(Turn(index=step, observation=observation, prompt_ids=renderer.render(ctx, [], turns).ids,
                              action_ids=ids, student_logprobs=[-1.0] * len(ids)))
            history.append((observation, action))
        out.append(Trajectory(task_id=f"walk{i}", env_name="alfworld", turns=turns))
    return out


def measure(walks_file: str, style: str, model_dir: str) -> dict:
    """One train step (the full estimator, the same tiny model as teacher) on the walks rendered in
    `style`: its tokens, env steps, seconds and peak memory above the process's before it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turnopd.config import LossConfig, ObjectiveConfig, TrainerConfig
    from turnopd.core.types import build_token_batch
    from turnopd.trainer import Trainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = trajectories(json.loads(Path(walks_file).read_text()), style, tokenizer)
    tokens = build_token_batch(batch)
    student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = Trainer(student, TrainerConfig(lr=0.0, micro_batch_tokens=16384), ObjectiveConfig(estimator="full"),
                      LossConfig(mode="progressive"), total_steps=2, teacher_model=teacher)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    trainer.step(tokens, 0.5)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"style": style, "tokens": tokens.num_tokens, "sequences": len(tokens.seq_lens),
            "env_steps": sum(t.depth for t in batch), "seconds": seconds, "peak_mib": peak / 1024}


def tiny_model(folder: Path) -> Path:
    """A tiny random model with SmolLM2-135M-Instruct's tokenizer and template."""
    from turnopd.models.smollm2 import smollm2_tokenizer
    from turnopd.models.tiny import build_tiny_model

    smollm2_tokenizer().save_pretrained(folder / "tokenizer")
    return build_tiny_model(folder / "model", tokenizer=folder / "tokenizer", hidden_size=64, num_layers=2,
                            num_heads=2, max_position_embeddings=32768, seed=0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--episodes", type=int, default=2)
    p.add_argument("--measure", nargs=3, metavar=("WALKS", "STYLE", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:  # a child process: one measurement, printed as JSON
        print(json.dumps(measure(*args.measure)))
        return 0
    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        for horizon in HORIZONS:
            walks = Path(tmp) / f"walks{horizon}.json"
            walks.write_text(json.dumps(random_walks(args.episodes, horizon, seed=horizon)))
            for repeat in range(args.repeats):
                for style in STYLES:  # interleaved, so that drift in the machine's load hits both alike
                    out = subprocess.run([sys.executable, __file__, "--measure", str(walks), style, str(model)],
                                         check=True, capture_output=True, text=True).stdout
                    samples.append({"horizon": horizon, "repeat": repeat, **json.loads(out.splitlines()[-1])})
    save_result("chat_context", "prompt.style chat vs history_block on the same ALFWorld walks: tokens per env step, "
                "train-step time and peak memory (SmolLM2 tokenizer, tiny model, full estimator)",
                summaries(samples), samples,
                notes=f"{args.episodes} random-walk episodes per horizon; a fresh process per measurement")
    return 0


def summaries(samples: list[dict]) -> list[Summary]:
    rows = []
    for horizon in HORIZONS:
        for style in STYLES:
            mine = [s for s in samples if s["horizon"] == horizon and s["style"] == style]
            rows += [Summary.of(f"{style} {horizon} turns: tokens per env step", [s["tokens"] / s["env_steps"]
                                                                                  for s in mine], "tok"),
                     Summary.of(f"{style} {horizon} turns: train step", [s["seconds"] for s in mine], "s"),
                     Summary.of(f"{style} {horizon} turns: step peak memory", [s["peak_mib"] for s in mine], "MiB")]
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
