"""What the familiarity signals cost: a train step of the `full` estimator (the teacher in the
training process, as in the quickstart) with and without the signals its teacher forward also
computes, side by side in one run on the quickstart's models.

    python benchmarks/familiarity_overhead.py                 # 5 repeats, 8 trajectories of 25 turns

The batch is the quickstart's shape (a 1-turn history window: a ~300-token prompt per turn, 12-token
actions) with random tokens; "without" replaces the signals' readout (the head over every prompt
token and the entropy at the action tokens) with nothing. Reported: the median step time of each
(and its range) and their ratio paired per repeat, saved to benchmarks/results/familiarity_overhead.json.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from record import Summary, save_result
from transformers import AutoModelForCausalLM

import turnopd.trainer.trainer as trainer_module
from turnopd.config import LossConfig, ObjectiveConfig, TrainerConfig
from turnopd.core.types import Trajectory, Turn, build_token_batch
from turnopd.trainer import Trainer

TEACHER = Path("runs/teachers/alfworld")
STUDENT = Path("~/.cache/turnopd/models/alfworld-student-sft400").expanduser()


def batch(vocab: int, trajectories: int, turns: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(trajectories):
        out.append(Trajectory(task_id=f"t{i}", env_name="alfworld", turns=[
            Turn(index=t, observation="", prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(250, 350))],
                 action_ids=(action := [rng.randrange(vocab) for _ in range(12)]), student_logprobs=[-1.0] * len(action))
            for t in range(turns)]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--turns", type=int, default=25)
    args = p.parse_args()
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float32)
    trainer = Trainer(student, TrainerConfig(lr=0.0, micro_batch_tokens=8192), ObjectiveConfig(estimator="full"),
                      LossConfig(mode="progressive"), total_steps=2 * args.repeats + 1, teacher_model=teacher)
    tokens = build_token_batch(batch(teacher.config.vocab_size, args.trajectories, args.turns))
    trainer.step(tokens, 0.5)  # warm-up
    with_signals = trainer_module.turn_signals
    times: dict[str, list[float]] = {"with signals": [], "without": []}
    for _ in range(args.repeats):  # interleaved, so that drift in the machine's load hits both alike
        for name, readout in (("with signals", with_signals), ("without", lambda *a, **k: {})):
            trainer_module.turn_signals = readout
            start = time.perf_counter()
            trainer.step(tokens, 0.5)
            times[name].append(time.perf_counter() - start)
    trainer_module.turn_signals = with_signals
    found = [Summary.of(f"{name}: s per step", values, "s") for name, values in times.items()]
    found.append(Summary.of("with the signals / without", [a / b for a, b in zip(times["with signals"], times["without"],
                                                                                  strict=True)], "x"))
    save_result("familiarity_overhead", f"familiarity signals' cost: a train step of the full estimator with and "
                f"without them (quickstart models, {tokens.num_tokens} tokens, {tokens.num_action_tokens} action "
                "tokens a step)", found, [{"side": name, "seconds": values} for name, values in times.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
