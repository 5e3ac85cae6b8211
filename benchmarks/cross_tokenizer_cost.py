"""What a teacher of another tokenizer adds to a step (issue 61; docs/results/cross-tokenizer-design.md):
real steps of `recipes/alfworld/cross_tokenizer.yaml` (the tiny student, the SmolLM2-135M teacher,
objective.tokenizers=cross), with the alignment's parts timed inside them:

- the teacher's rendering of each prompt in its own template and tokens (TeacherTokens' teacher view),
- the byte alignment of each action (token_alignment.cross_tokens, in finish_turn),
- spreading the teacher's log-probs (and top-k) over the student's tokens (teachers.scoring).

    python benchmarks/cross_tokenizer_cost.py --steps 4

Per step: the alignment's seconds as a share of the step's wall-clock, and the teacher's scoring
(its forward, the ledger's "teacher" busy time) beside it; the median over the steps (each step a
repeat) with the range, into benchmarks/results/cross_tokenizer_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from record import Summary, save_result

import teachers.scoring as scoring
import turnopd.orchestration.distill as distill
import turnopd.rollout.render as render
from turnopd.core.metrics import StepRecord, read_metrics
from turnopd.orchestration.recipe import load_recipe

RECIPE = "recipes/alfworld/cross_tokenizer.yaml"
aligning = [0.0]  # seconds spent on alignment so far


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            aligning[0] += time.perf_counter() - start
    return wrapper


class TimedRenderer:
    """The teacher's view with its `render` timed (the rest passed through)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.render = timed(inner.render)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def instrument() -> list[float]:
    """Time the alignment's parts; returns the list that receives the running total at each step's end."""
    render.cross_tokens = timed(render.cross_tokens)
    scoring.spread_teacher_logprobs = timed(scoring.spread_teacher_logprobs)
    scoring.span_first_topk = timed(scoring.span_first_topk)
    init = render.TeacherTokens.__init__

    def timed_init(self: render.TeacherTokens, student: Any, teacher: Any, *args: Any) -> None:
        init(self, student, TimedRenderer(teacher), *args)

    render.TeacherTokens.__init__ = timed_init
    at_step_end: list[float] = []
    end_step = distill.end_step

    def recorded_end_step(*args: Any, **kwargs: Any) -> Any:
        at_step_end.append(aligning[0])
        return end_step(*args, **kwargs)

    distill.end_step = recorded_end_step
    return at_step_end


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="cross_cost_"))
    cfg = dataclasses.replace(load_recipe(RECIPE, [f"trainer.steps={args.steps}", "tracking=[]", "checkpoint.every=0",
                                                   "eval.max_tasks=1", "objective.estimator=k1"]),
                              output_dir=str(out), name="cost")
    at_step_end = instrument()
    distill.run_distillation(cfg)
    records = [StepRecord.from_json(r) for r in read_metrics(out / "cost" / "metrics.jsonl") if r.get("kind") == "train"]
    align = [b - a for a, b in zip([0.0, *at_step_end], at_step_end, strict=False)]
    steps = [{"step": r.step, "step_time_s": r.step_time_s, "alignment_s": s, "teacher_s": r.busy.get("teacher", 0.0),
              "tokens_scored": r.tokens_scored, "turns": r.env_steps} for r, s in zip(records, align, strict=True)]
    found = [Summary.of("alignment: s per step", [s["alignment_s"] for s in steps], "s"),
             Summary.of("alignment: share of the step", [100 * s["alignment_s"] / s["step_time_s"] for s in steps], "%"),
             Summary.of("teacher scoring: share of the step", [100 * s["teacher_s"] / s["step_time_s"] for s in steps], "%"),
             Summary.of("step: s", [s["step_time_s"] for s in steps], "s")]
    save_result("cross_tokenizer_cost", "a teacher of another tokenizer: the alignment's share of a step (tiny student, "
                "SmolLM2-135M teacher, 8 ALFWorld episodes a step; each step a repeat)", found, steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
