"""`turnopd teacher lead RECIPE`: does the recipe's teacher lead its student on the held-out tasks?

A distillation experiment shows nothing when its teacher does not lead its student, so each one checks
this first (its gate). Both play the recipe's held-out tasks as a run's start evaluation plays them
(eval.split, eval.max_tasks, eval.k, eval.temperature, the run's seed): the student exactly as
`turnopd distill` evaluates it before step 1, the teacher through the same cached evaluation as
eval.teacher (so a gate and a run's start records agree, and a teacher is played once per setting).
The lead is paired by task (turnopd.analysis.audit.teacher_lead); a multi-env recipe gets one per env.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from envs.pool import EnvPool
from turnopd.analysis.audit import teacher_lead
from turnopd.config import RecipeError, RunConfig
from turnopd.core.source import code_build
from turnopd.orchestration.audit import student_policy
from turnopd.orchestration.evaluation import evaluate_teacher, run_eval
from turnopd.orchestration.pipeline import env_parts
from turnopd.orchestration.preflight import check_setup
from turnopd.orchestration.run_log import model_builds
from turnopd.orchestration.startup import build_missing_models, seed_everything


def run_teacher_lead(cfg: RunConfig, *, student: str | None = None, min_points: float = 20.0) -> dict[str, Any]:
    """Evaluate the student (the recipe's, or `student`: a model, checkpoint or run folder), then each
    env's teacher, on the held-out tasks; returns the report (each env's two evaluations and the lead)."""
    setup, _ = check_setup(cfg)
    for env, spec in setup.teacher_specs.items():
        if spec.backend == "vllm_server":
            raise RecipeError(f"recipe key 'teachers.{env}': {spec.name} is reached through a server, which scores "
                              "tokens but does not play episodes here; give a spec of its local model")
    build_missing_models(cfg, setup)
    seed_everything(cfg.seed)
    clock = time.perf_counter()
    parts = env_parts(cfg, setup)
    report: dict[str, Any] = {
        "recipe": cfg.name, "min_points": min_points,
        "code": code_build(), "envs": {}}
    with ExitStack() as stack:  # each env's pool serves both players: its workers start once
        pools = {env: stack.enter_context(EnvPool.for_config(part.spec, view.env)) for env, (view, part) in parts.items()}
        policy, student_name = student_policy(cfg, setup.student_path, student, setup.spec)
        try:
            students = {env: run_eval(view, part, pools[env], policy, step=0) for env, (view, part) in parts.items()}
        finally:
            policy.close()  # before a teacher loads: one model in memory at a time
        for env, (view, part) in parts.items():
            spec = part.teacher_specs[env]
            teacher = evaluate_teacher(view, part, spec, pools[env])
            report["envs"][env] = {
                "split": part.eval_split, "k": view.eval.k,
                "temperature": view.eval.temperature if view.eval.k > 1 else 0.0,  # k = 1 is greedy
                "max_turns": view.env.max_turns, "teacher_name": spec.name,
                "teacher": teacher.record(), "student": students[env].record(),
                "lead": teacher_lead(teacher.per_task, students[env].per_task, min_points),
            }
    # which builds, as a run's start record names them
    report["student"] = student_name
    report["models"] = model_builds(dataclasses.replace(setup, student_path=Path(student_name)))
    report["passes"] = all(e["lead"]["passes"] for e in report["envs"].values())
    report["seconds"] = time.perf_counter() - clock
    return report
