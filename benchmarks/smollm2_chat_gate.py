"""The gate of the SmolLM2 chat distillation (docs/results/smollm2-chat-design.md): does the teacher
lead the student by >= 20 points on the 50 held-out games? Both models play every game greedily in the
distillation recipe's own setting (recipes/alfworld/smollm2_chat.yaml: one conversation per episode in
SmolLM2's ChatML, the compact template, 30 turns), one after the other in one process; the result holds
each game's outcome for both, so the lead's interval is paired by game.

    # in the vLLM install (README); the conversations of 50 games need more than vLLM's default 1 GiB of KV cache
    VLLM_CPU_KVCACHE_SPACE=8 python benchmarks/smollm2_chat_gate.py STUDENT_DIR TEACHER_DIR
    # one model on the first 10 games (no lead): teacher_10_games.json
    VLLM_CPU_KVCACHE_SPACE=4 python benchmarks/smollm2_chat_gate.py STUDENT_DIR TEACHER_DIR --only teacher \
        eval.max_tasks=10 policy.max_batch_size=10

Cost: its first run (2026-12-06, 2 cores shared with a test suite) had not finished the teacher's
50 games after 45 min. On CPU, decoding at batch 50 over conversations of several thousand tokens
reads the whole KV cache (float32: ~46 KB a token for SmolLM2-135M) at every generated token, so it
is memory-bound; a quiet machine, or a GPU, is where it belongs.
writes benchmarks/results/smollm2_chat/gate.json (and prints the table).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from envs import make_env_spec
from turnopd.analysis.frontier import t_interval
from turnopd.orchestration.preflight import train_and_eval_tasks
from turnopd.orchestration.recipe import load_recipe
from turnopd.orchestration.sft import evaluate_sft_model

RECIPE = "recipes/alfworld/smollm2_chat.yaml"
GATE_POINTS = 20.0
OUT = Path("benchmarks/results/smollm2_chat/gate.json")


def play(cfg, spec, model_dir: str, tasks: list[str], split: str) -> dict:
    """One model's greedy episodes on `tasks` (the SFT evaluation's own code): per-game success,
    turns and invalid actions."""
    start = time.perf_counter()
    result = evaluate_sft_model(cfg, spec, Path(model_dir), "float32", tasks, split)
    turns = [turn for t in result.trajectories for turn in t.turns]
    return {"model": model_dir, "success": result.avg_at_k, "per_task": result.per_task,
            "mean_turns": result.mean_turns, "invalid_rate": sum(t.invalid for t in turns) / max(1, len(turns)),
            "truncated": sum(t.truncated for t in result.trajectories), "env_failures": result.env_failures,
            "seconds": time.perf_counter() - start}


def paired_lead(teacher: dict, student: dict) -> dict:
    """Teacher minus student in points, t interval over the games of the per-game differences."""
    diffs = [100 * (teacher["per_task"][task] - student["per_task"][task]) for task in teacher["per_task"]]
    lead = t_interval(diffs)
    assert lead is not None, "the gate needs at least 2 games"
    return {"games": len(diffs), "lead_points": lead.value, "interval": [lead.lo, lead.hi],
            "teacher_only": sum(d > 0 for d in diffs), "student_only": sum(d < 0 for d in diffs),
            "gate_points": GATE_POINTS, "passes": lead.value >= GATE_POINTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("student")
    parser.add_argument("teacher")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (e.g. eval.max_tasks=2 for a smoke run)")
    parser.add_argument("--only", choices=("teacher", "student"),
                        help="play one model only (no lead): writes <role>_<games>_games.json beside gate.json")
    args = parser.parse_args()
    cfg = load_recipe(RECIPE, ["policy.backend=vllm", "policy.max_batch_size=50", *args.overrides])
    spec = make_env_spec(cfg.env, cfg.data_dir)
    _, _, split, tasks = train_and_eval_tasks(spec, cfg.env, eval_split=cfg.eval.split,
                                              max_eval_tasks=cfg.eval.max_tasks)
    print(f"gate: {len(tasks)} {split} games, greedy, {cfg.env.max_turns} turns, prompt.style={cfg.prompt.style}",
          flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    played = {}
    for role in (args.only,) if args.only else ("teacher", "student"):
        played[role] = play(cfg, spec, getattr(args, role), tasks, split)
        print(f"{role}: {100 * played[role]['success']:.1f}% ({played[role]['mean_turns']:.1f} turns, "
              f"{100 * played[role]['invalid_rate']:.1f}% invalid actions, {played[role]['seconds']:.0f} s)", flush=True)
    if args.only:
        out = OUT.with_name(f"{args.only}_{len(tasks)}_games.json")
        out.write_text(json.dumps({"recipe": RECIPE, "split": split, "max_turns": cfg.env.max_turns, **played}, indent=1)
                       + "\n")
        print(f"wrote {out}")
        return
    lead = paired_lead(played["teacher"], played["student"])
    lo, hi = lead["interval"]
    print(f"lead: {lead['lead_points']:+.1f} points [{lo:+.1f}, {hi:+.1f}] over {lead['games']} games "
          f"(teacher alone won {lead['teacher_only']}, student alone {lead['student_only']}); gate "
          f">= {GATE_POINTS:.0f}: {'passes' if lead['passes'] else 'FAILS'}")
    OUT.write_text(json.dumps({"recipe": RECIPE, "split": split, "max_turns": cfg.env.max_turns, **played,
                               "lead": lead}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
