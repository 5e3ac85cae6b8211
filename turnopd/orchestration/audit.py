"""`turnopd teacher audit RECIPE`: where is the teacher guessing? Teacher takeovers from student states
as the ground truth of the familiarity signals (turnopd.algorithm.familiarity).

1. The student (the recipe's, or a run's newest checkpoint) plays `episodes` training tasks (with
   `held_out`: the recipe's held-out eval tasks, games no teacher trained on, so that a teacher
   trained on student states of training games is not judged on those games) at full depth with the
   recipe's rollout sampling; the teacher scores them, which gives every turn its familiarity signals.
2. Up to `per_band` states per band of `band_width` turns are drawn from those episodes. From each
   (turn t of an episode), the teacher takes over: the env replays the student's first t actions,
   then the teacher plays greedily to the end, with env.max_turns turns of its own (a state late in
   an episode is judged by what can be done from it, not by the turns its episode had left). The
   student takes over from the same states the same way (greedy, same budget): the contrast. A
   takeover whose replay does not reproduce the student's observation at turn t is dropped and counted.
3. The report: takeover success by band beside the student's from the same states, and
   for each signal its AUC for predicting the takeover's success (with a bootstrap interval over the
   states), also within depth bands only (what a signal shares with depth, which the takeover success
   falls with, does not count there), its quantiles (candidate familiarity.threshold values) and its mean on won and lost states.
   Written to OUTPUT_DIR/<name>-audit/audit.json and audit.png.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from envs.base import EnvSpec
from envs.pool import EnvPool
from teachers import check_tokenizers, make_teachers, score_trajectories
from turnopd.algorithm.familiarity import FAMILIARITY_SIGNALS
from turnopd.analysis.audit import (
    auc,
    bootstrap_auc,
    oriented,
    plot_audit,
    quantiles,
    sample_states,
    wilson_interval,
)
from turnopd.config import RecipeError, RunConfig
from turnopd.core import checkpoint as ckpt
from turnopd.core.types import Trajectory
from turnopd.loaders.hf_models import load_model
from turnopd.loaders.screens import attach_screens
from turnopd.models.screen_reader import reader_for
from turnopd.orchestration.evaluation import teacher_policy
from turnopd.orchestration.pipeline import sample_tasks
from turnopd.orchestration.pipeline.plan import step_sampling
from turnopd.orchestration.preflight import Setup, check_setup, scoring_topk
from turnopd.orchestration.startup import build_missing_models, seed_everything
from turnopd.rollout import Policy, make_policy
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.eval import eval_sampling
from turnopd.rollout.takeover import Takeover

AUDIT_SALT = 7_777  # the audit's task draw, apart from any run's


def student_policy(cfg: RunConfig, default_path: Path, student: str | None, spec: EnvSpec) -> tuple[Policy, str]:
    """The student to audit and what it is: the recipe's (default), a model folder, a checkpoint
    folder, or a run folder (its newest checkpoint); a LoRA checkpoint plays as its adapter over the
    recipe's student. In an env that shows screenshots it sees them as it does in a run (attach_screens)."""
    policy, name = _student_policy(cfg, default_path, student)
    attach_screens(spec, name, policy, reader=reader_for(cfg.student))
    return policy, name


def _student_policy(cfg: RunConfig, default_path: Path, student: str | None) -> tuple[Policy, str]:
    path = Path(student).expanduser() if student else default_path
    if (path / "checkpoints").is_dir():
        checkpoints = ckpt.list_checkpoints(path)
        if not checkpoints:
            raise FileNotFoundError(f"--student {path}: the run has no checkpoint yet")
        path = checkpoints[-1]
    if not path.is_dir():
        raise FileNotFoundError(f"--student {path}: not a model, checkpoint or run folder")
    if (path / "adapter_config.json").is_file():
        model, tokenizer = load_model(str(default_path), cfg.student.dtype, adapter=str(path))
        return make_policy(cfg.policy, model, tokenizer=tokenizer, dtype=cfg.student.dtype, seed=cfg.seed), str(path)
    return make_policy(cfg.policy, str(path), dtype=cfg.student.dtype, seed=cfg.seed), str(path)


def band_summary(states: list[dict[str, Any]], band: int, width: int) -> dict[str, Any]:
    in_band = [s for s in states if s["band"] == band]
    won, student_won = sum(s["won"] for s in in_band), sum(s["student_won"] for s in in_band)
    return {"band": band, "first_turn": band * width, "last_turn": (band + 1) * width - 1, "states": len(in_band),
            "takeover": {"rate": won / len(in_band), "interval": wilson_interval(won, len(in_band))},
            "student": {"rate": student_won / len(in_band), "interval": wilson_interval(student_won, len(in_band))},
            "signals": {name: statistics.fmean(s["signals"][name] for s in in_band) for name in in_band[0]["signals"]}}


def signal_summary(states: list[dict[str, Any]], name: str, rng: np.random.Generator) -> dict[str, Any]:
    familiar = FAMILIARITY_SIGNALS.get(name).higher_is_familiar
    values = [s["signals"][name] for s in states]
    labels = [s["won"] for s in states]
    scores = [oriented(v, familiar) for v in values]
    won = [v for v, y in zip(values, labels, strict=True) if y]
    lost = [v for v, y in zip(values, labels, strict=True) if not y]
    bands = [s["band"] for s in states]
    return {"higher_is_familiar": familiar, "auc": auc(scores, labels), "auc_interval": bootstrap_auc(scores, labels, rng),
            "auc_within_bands": auc(scores, labels, bands),
            "auc_within_bands_interval": bootstrap_auc(scores, labels, rng, bands),
            "quantiles": quantiles(values), "mean_won": statistics.fmean(won) if won else None,
            "mean_lost": statistics.fmean(lost) if lost else None}


def state_records(trajectories: list[Trajectory], states: list[tuple[int, int]], takeovers: list[Trajectory],
                  student_takeovers: list[Trajectory], width: int) -> tuple[list[dict[str, Any]], int]:
    """One record per state whose replays reproduced the student's observation; and how many did not."""
    records, diverged = [], 0
    for (episode, turn), takeover, student in zip(states, takeovers, student_takeovers, strict=True):
        student_turn = trajectories[episode].turns[turn]
        if any(not t.turns or t.turns[0].observation != student_turn.observation for t in (takeover, student)):
            diverged += 1
            continue
        records.append({"episode": episode, "task_id": takeover.task_id, "turn": turn, "band": turn // width,
                        "signals": dict(student_turn.teacher_signals), "won": takeover.success,
                        "student_won": student.success, "takeover_turns": takeover.depth})
    return records, diverged


def check_audit_setup(cfg: RunConfig) -> tuple[Setup, list[str]]:
    """check_setup's, for an audit: its rollouts and scoring read the student's own token ids, so a
    teacher of another tokenizer (objective.tokenizers=cross) is refused."""
    if cfg.objective.tokenizers == "cross":
        raise RecipeError("recipe key 'objective.tokenizers': cross is not built for `turnopd audit`, which "
                          "scores the student's own token ids; audit with a teacher of the student's tokenizer")
    return check_setup(cfg)


def run_audit(cfg: RunConfig, *, student: str | None = None, episodes: int = 16, per_band: int = 12,
              band_width: int = 10, held_out: bool = False) -> dict[str, Any]:
    """Play, score, take over and summarize (see the module docstring); returns the report."""
    setup, _ = check_audit_setup(cfg)
    build_missing_models(cfg, setup)
    seed_everything(cfg.seed)
    spec = setup.teacher_specs[cfg.env.name]
    out_dir = Path(cfg.output_dir).expanduser() / f"{cfg.name}-audit"
    teachers = make_teachers({cfg.env.name: spec})
    clock = time.perf_counter()
    greedy = eval_sampling(cfg.policy, 1, 1.0, cfg.seed)
    with EnvPool.for_config(setup.spec, cfg.env) as pool:
        policy, student_name = student_policy(cfg, setup.student_path, student, setup.spec)
        try:
            check_tokenizers(policy.tokenizer, teachers[cfg.env.name].tokenizer, student_name, spec.name)
            split = setup.eval_split if held_out else cfg.env.train_split
            tasks = sample_tasks(setup.eval_tasks if held_out else setup.train_tasks, episodes, cfg.seed, 0, AUDIT_SALT)
            print(f"audit: the student ({student_name}) plays {episodes} {split} episodes at full "
                  f"depth ({cfg.env.max_turns} turns)", flush=True)
            trajectories = rollout(setup.spec, pool, policy, tasks, env_config=cfg.env,
                                   sampling=step_sampling(cfg, 0), prompt=cfg.prompt)
            score_trajectories(teachers, trajectories, topk=scoring_topk(cfg))
            for teacher in teachers.values():
                teacher.close()
            states = sample_states([t.depth for t in trajectories], band_width, per_band, cfg.seed)
            state_tasks = [trajectories[e].task_id for e, _ in states]
            replays = [[setup.spec.parse_action(turn.action_text).action for turn in trajectories[e].turns[:t]]
                       for e, t in states]
            print(f"audit: {sum(t.depth for t in trajectories)} student states, mean depth "
                  f"{statistics.fmean(t.depth for t in trajectories):.1f} ({time.perf_counter() - clock:.0f} s); the "
                  f"student, then the teacher ({spec.name}), take over from {len(states)} of them, greedily",
                  flush=True)
            student_takeovers = rollout(setup.spec, Takeover(pool, replays), policy, state_tasks, env_config=cfg.env,
                                        sampling=greedy, prompt=cfg.prompt)
        finally:
            policy.close()
        takeover_policy = teacher_policy(cfg, spec)
        try:
            takeovers = rollout(setup.spec, Takeover(pool, replays), takeover_policy, state_tasks, env_config=cfg.env,
                                sampling=greedy, prompt=cfg.prompt)
        finally:
            takeover_policy.close()
    records, diverged = state_records(trajectories, states, takeovers, student_takeovers, band_width)
    if not records:
        raise RuntimeError(f"no takeover reproduced its student state ({diverged} replays diverged): the env "
                           "does not replay deterministically, so it cannot be audited this way")
    rng = np.random.default_rng(cfg.seed)
    report = {
        "recipe": cfg.name, "student": student_name, "teacher": spec.name, "episodes": episodes, "split": split,
        "student_success": statistics.fmean(t.success for t in trajectories), "band_width": band_width,
        "per_band": per_band, "diverged": diverged, "seconds": time.perf_counter() - clock,
        "bands": [band_summary(records, b, band_width) for b in sorted({r["band"] for r in records})],
        "signals": {name: signal_summary(records, name, rng) for name in sorted(records[0]["signals"])},
        "states": records,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plot"] = str(plot_audit(report, out_dir / "audit.png"))
    report["path"] = str(out_dir / "audit.json")
    return report
