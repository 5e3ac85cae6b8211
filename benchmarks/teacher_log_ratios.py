"""How sharply each teacher of issue 61's comparison rates the student's own turns
(docs/results/*-cross-tokenizer.md): the quickstart's tiny student plays train games of
recipes/alfworld/cross_tokenizer.yaml (temperature 0.5, as in its rollouts); each turn is scored by
the SmolLM2 teacher through the aligned spans (the recipe's own scoring path) and by the tiny 800-step
teacher on the student's own tokens. Per turn, the log-ratio is the teacher's log-prob of the
student's answer minus the student's sampling log-prob of it (what k1's per-token advantages add up
to over the turn).

    python benchmarks/teacher_log_ratios.py --episodes 16      # ~5 min on 2 cores

Writes benchmarks/results/cross_tokenizer/log_ratios.json: each teacher's per-turn log-ratios and
their summary (mean, median, 10th percentile, the least, the share of turns below -5 nats), and the
turns the SmolLM2 teacher rates lowest; and the alignment's check, the largest difference over the turns
between the sum of T'_p over an answer (the aligned spans) and the SmolLM2 teacher's log-prob of the
answer's text read directly.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch
from cross_tokenizer import RESULTS
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import make_env_spec
from envs.pool import EnvPool
from teachers.scoring import score_trajectories
from teachers.spec import load_teacher_spec, make_teacher
from turnopd.orchestration.preflight import train_and_eval_tasks
from turnopd.orchestration.recipe import load_recipe
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.base import SamplingParams, make_policy

RECIPE = "recipes/alfworld/cross_tokenizer.yaml"
SMOLLM2 = "teachers/alfworld/smollm2.yaml"
TINY = "teachers/alfworld/teacher.yaml"
LOW = -5.0  # nats: a turn the teacher finds e^5 ~ 150 times less likely than the student does


def action_logprobs(model: torch.nn.Module, prompt: list[int], action: list[int]) -> list[float]:
    """The model's log-prob of each action token after the prompt, [len(action)]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + action])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(action)[:, None])[:, 0].tolist()


def summary(ratios: list[float]) -> dict[str, float]:
    ordered = sorted(ratios)
    return {"turns": len(ordered), "mean": statistics.fmean(ordered), "median": statistics.median(ordered),
            "p10": ordered[len(ordered) // 10], "min": ordered[0],
            "share_below_-5": sum(r < LOW for r in ordered) / len(ordered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=20)
    args = parser.parse_args()
    cfg = load_recipe(RECIPE, [f"env.max_turns={args.max_turns}"])
    spec = make_env_spec(cfg.env, cfg.data_dir)
    _, train, _, _ = train_and_eval_tasks(spec, cfg.env, eval_split=cfg.eval.split, max_eval_tasks=1)
    tasks = random.Random(cfg.seed).sample(train, args.episodes)
    policy = make_policy(cfg.policy, str(Path(cfg.student.path).expanduser()), dtype="float32", seed=cfg.seed)
    smollm2 = load_teacher_spec(SMOLLM2)
    sampling = SamplingParams(temperature=cfg.policy.temperature, top_p=cfg.policy.top_p,
                              max_new_tokens=cfg.policy.max_new_tokens, seed=cfg.seed)
    with EnvPool.for_config(spec, cfg.env) as pool:
        trajectories = rollout(spec, pool, policy, tasks, env_config=cfg.env, sampling=sampling, prompt=cfg.prompt,
                               teacher_tokenizer=AutoTokenizer.from_pretrained(smollm2.model))
    score_trajectories({"alfworld": make_teacher(smollm2)}, trajectories)  # T'_p through the aligned spans
    tiny = AutoModelForCausalLM.from_pretrained(load_teacher_spec(TINY).model, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(smollm2.model, dtype=torch.float32)
    turns = [turn for t in trajectories for turn in t.turns]
    # the alignment's check: the spans carry the teacher's log-prob of the answer's text whole (sum T'_p)
    direct = [sum(action_logprobs(teacher, turn.teacher_prompt_ids, turn.teacher_action_ids)) for turn in turns]
    alignment_error = max(abs(d - sum(turn.teacher_logprobs)) for d, turn in zip(direct, turns, strict=True))
    rows = [{"action": policy.tokenizer.decode(turn.action_ids), "invalid": turn.invalid,
             "smollm2": sum(turn.teacher_logprobs) - sum(turn.student_logprobs),
             "tiny": sum(action_logprobs(tiny, turn.prompt_ids, turn.action_ids)) - sum(turn.student_logprobs)}
            for turn in turns]
    result = {"recipe": RECIPE, "episodes": args.episodes, "max_turns": args.max_turns,
              "won": sum(t.success for t in trajectories),
              "max_abs_sum_T_prime_minus_direct": alignment_error,
              "summary": {name: summary([r[name] for r in rows]) for name in ("smollm2", "tiny")},
              "lowest_smollm2": sorted(rows, key=lambda r: r["smollm2"])[:10], "turns": rows}
    out = RESULTS / "log_ratios.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1), f"alignment check: max |sum T' - direct| {alignment_error:.2e} nats")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
