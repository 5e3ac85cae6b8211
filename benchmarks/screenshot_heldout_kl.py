"""How far the screenshot student is from its text teacher on held-out goals, before and after
distillation: the measure the recipe's before/after table lacks when neither model wins a goal.

    turnopd sweep recipes/webshop/screenshot.yaml --methods turnopd --seeds 3   # the runs, first
    python benchmarks/screenshot_heldout_kl.py runs/screenshot-turnopd-s0 runs/screenshot-turnopd-s1 runs/screenshot-turnopd-s2

Per run: the student before (the run's student folder) and after (its last checkpoint) plays the
first --tasks test goals of webshop_screenshot (greedy, up to env.max_turns turns, the run's env
settings); the run's text teacher scores every action token after the pages' text, and the
per-token KL estimate is the mean of log pi_student(a) - log pi_teacher(a) over the action tokens
(k1 of the student's own greedy tokens), with the goals won and the invalid-action rate beside it.
Printed per run, then the mean over runs of after - before with a t interval over the runs; saved
to benchmarks/results/screenshot_heldout_kl.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from omegaconf import OmegaConf
from record import Summary, save_result

from envs import make_env_spec
from envs.pool import EnvPool
from teachers import make_teachers
from teachers.scoring import score_trajectories
from teachers.spec import load_teacher_spec
from turnopd.config import EnvConfig, PolicyConfig
from turnopd.core.checkpoint import list_checkpoints
from turnopd.loaders.screens import attach_screens
from turnopd.rollout import SamplingParams, make_policy
from turnopd.rollout.agent_loop import rollout


def measure(model: Path, processor_dir: Path, spec, config: EnvConfig, teachers, tasks: list[str]) -> dict:
    policy = make_policy(PolicyConfig(backend="transformers", max_new_tokens=48), str(model), dtype="float32", seed=0)
    attach_screens(spec, processor_dir, policy)
    with EnvPool.for_config(spec, config) as pool:
        trajectories = rollout(spec, pool, policy, tasks, env_config=config,
                               sampling=SamplingParams(temperature=0, max_new_tokens=48, seed=0))
    score_trajectories(teachers, trajectories)
    spec.pixel_store.clear()
    gaps = [s - t for traj in trajectories for turn in traj.turns
            for s, t in zip(turn.student_logprobs, turn.teacher_logprobs, strict=True)]
    turns = [turn for traj in trajectories for turn in traj.turns]
    return {"kl": sum(gaps) / len(gaps), "won": sum(t.success for t in trajectories), "goals": len(trajectories),
            "invalid": sum(t.invalid for t in turns) / len(turns), "turns": len(turns)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--tasks", type=int, default=20)
    args = parser.parse_args()
    samples = []
    for run in args.runs:
        cfg = OmegaConf.load(run / "config.yaml")
        config = EnvConfig(**{**OmegaConf.to_container(cfg.env), "num_workers": 2})
        spec = make_env_spec(config)
        teachers = make_teachers({env: load_teacher_spec(path) for env, path in cfg.teachers.items()})
        student = Path(cfg.student.path).expanduser()
        tasks = spec.tasks(config.eval_split)[: args.tasks]
        before = measure(student, student, spec, config, teachers, tasks)
        after = measure(list_checkpoints(run)[-1], student, spec, config, teachers, tasks)
        samples.append({"run": str(run), "before": before, "after": after})
        print(f"{run.name}: KL {before['kl']:.3f} -> {after['kl']:.3f}, won {before['won']} -> {after['won']} "
              f"of {before['goals']}, invalid {before['invalid']:.2f} -> {after['invalid']:.2f}", flush=True)
    deltas = [s["after"]["kl"] - s["before"]["kl"] for s in samples]
    summaries = [Summary.of("held-out per-token KL to the teacher, before", [s["before"]["kl"] for s in samples], "nats"),
                 Summary.of("held-out per-token KL to the teacher, after", [s["after"]["kl"] for s in samples], "nats"),
                 Summary.of("after - before", deltas, "nats")]
    if len(deltas) > 1:
        half = statistics.stdev(deltas) / len(deltas) ** 0.5 * {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78}.get(len(deltas), 2.0)
        print(f"after - before: {statistics.mean(deltas):+.3f} nats, 95% t interval over {len(deltas)} runs "
              f"[{statistics.mean(deltas) - half:+.3f}, {statistics.mean(deltas) + half:+.3f}]")
    save_result("screenshot_heldout_kl", f"screenshot student against its text teacher on {args.tasks} held-out goals",
                summaries, samples)


if __name__ == "__main__":
    sys.exit(main())
