"""`turnopd distill`: the on-policy distillation loop. One orchestrator, top to bottom.

Per optimizer step k of K:
    (probe: full-depth rollouts, teacher scoring, depth-controller update)  -- when the schedule says
    rollouts at the current depth cap -> teacher scoring -> loss + optimizer step -> weight sync
    -> metrics (+ evaluation every eval.every steps, + checkpoint every checkpoint.every steps)

On a probe step the probes are that step's training batch (they are full-depth, on-policy and
already scored: discarding them would waste their cost); the next steps use the updated cap.

The step's scored trajectories come from a rollout source (turnopd.pipeline, `pipeline.mode`):
played here (sync), or by a generator process that overlaps generation with training
(one_step_off, pool).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from envs.base import EnvSpec
from envs.pool import EnvPool
from teachers import build_missing_teacher, check_tokenizers, make_teacher
from turnopd import checkpoint as ckpt
from turnopd.budget import DepthSchedule, loss_alpha, make_depth_schedule
from turnopd.config import ModelConfig, RecipeError, RunConfig, to_yaml
from turnopd.distributed import barrier, gather_objects, rank_and_world
from turnopd.eval import EvalResult, avg_at_k, evaluate
from turnopd.ledger import Ledger
from turnopd.methods import method_of
from turnopd.metrics import MetricsWriter, truncate_after_step
from turnopd.models import prepare_model
from turnopd.objective import turn_kl_profile
from turnopd.pipeline import PipelineStats, open_rollouts, plan_batch
from turnopd.pipeline import (
    sample_tasks as sample_tasks,  # re-exported: a step's tasks were drawn here before the pipeline
)
from turnopd.preflight import check_setup
from turnopd.progress import StepProgress, print_summary
from turnopd.rollout import POLICY_BACKENDS, Policy
from turnopd.trainer import Trainer
from turnopd.trainer.engine import init_process_group, resolve_dtype
from turnopd.types import EpisodeSummary, build_token_batch, describe_env_errors, env_errors


class EnvFailed(RuntimeError):
    """The env ended every episode of a step itself (crashes, hangs, a game it cannot load): the agent
    played nothing to learn from, and later steps would fare the same."""


@dataclass
class Setup:
    """Everything the loop needs, checked before any heavy work."""

    spec: EnvSpec
    train_tasks: list[str]
    eval_tasks: list[str]
    eval_split: str
    student_path: Path
    teacher_specs: dict[str, Any]


def load_student(model_cfg: ModelConfig, path: Path):
    """The student model in `student.dtype` (as the trainer reads `auto`) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = resolve_dtype(model_cfg.dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)


def new_run_dir(cfg: RunConfig) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... when a run of that name exists (use --resume to continue it)."""
    base = Path(cfg.output_dir) / cfg.name
    run_dir, i = base, 1
    while (run_dir / "metrics.jsonl").exists():
        i += 1
        run_dir = base.with_name(f"{base.name}-{i}")
    return run_dir


def check_resume_config(run_dir: Path, cfg: RunConfig) -> None:
    saved = OmegaConf.load(run_dir / "config.yaml")
    now = OmegaConf.create(to_yaml(cfg))
    diff = [k for k in set(saved) | set(now) if saved.get(k) != now.get(k)]
    if diff:
        raise RecipeError(f"--resume {run_dir}: the recipe differs from the run's config.yaml in {sorted(diff)}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_eval(cfg: RunConfig, setup: Setup, pool: EnvPool, policy: Policy, step: int, ledger: Ledger) -> EvalResult:
    """Avg@k on this rank's share of the eval tasks, combined over ranks."""
    rank, world = rank_and_world()
    shard = setup.eval_tasks[rank::world]  # empty on the last ranks when there are fewer tasks than ranks
    local = evaluate(setup.spec, pool, policy, shard, split=setup.eval_split, env_config=cfg.env,
                     policy_config=cfg.policy, k=cfg.eval.k, temperature=cfg.eval.temperature,
                     seed=cfg.seed + step).trajectories if shard else []
    episodes = [e for part in gather_objects([EpisodeSummary.of(t) for t in local]) for e in part]
    overall, per_type = avg_at_k(episodes, cfg.eval.k)
    return EvalResult(setup.eval_split, cfg.eval.k, overall, per_type, len(setup.eval_tasks),
                      sum(e.depth for e in episodes) / len(episodes), env_errors(episodes))


def step_record(step: int, ledger: Ledger, phases: dict[str, float], depth: DepthSchedule, cap: int,
                probed: bool, alpha: float, train: dict[str, Any], episodes: list[EpisodeSummary],
                tokens_generated: int, pipeline: PipelineStats) -> dict[str, Any]:
    last = getattr(depth, "last", {}) if probed else {}
    turns = sum(e.depth for e in episodes)
    return {
        "kind": "train", "step": step, "train_time_s": ledger.train_time(), "wall_time_s": ledger.wall_time(),
        "phases": phases, "step_time_s": ledger.last_step_time_s, "generator_phases": ledger.last_generator_phases,
        "pipeline": dataclasses.asdict(pipeline), "rollout_depth_cap": cap, "probed": probed,
        "h_eff": last.get("h_eff"), "h_cov": last.get("h_cov"), "alpha": alpha,
        "loss": train["loss"], "grad_norm": train.get("grad_norm"), "lr": train.get("lr"),
        "mean_kl": train["mean_kl"], "turn_kl_profile": turn_kl_profile(train["turn_kl"]),
        "deep_turn_share": train["deep_turn_share"], "skipped": train["skipped"],
        "tokens_generated": tokens_generated, "tokens_trained": train["tokens_trained"],
        "episodes": len(episodes), "mean_turns": turns / len(episodes),
        "success_rate": sum(e.success for e in episodes) / len(episodes),
        "truncated_rate": sum(e.truncated for e in episodes) / len(episodes),
        "invalid_action_rate": sum(e.invalid_actions for e in episodes) / max(turns, 1),
        "env_failures": sum(e.failed_by_env for e in episodes), "env_errors": env_errors(episodes),
    }


def run_distillation(cfg: RunConfig, resume: str | None = None) -> dict[str, Any]:
    setup, _ = check_setup(cfg)  # fails fast, naming the problem: data, splits, models, teacher specs
    run_dir = Path(resume) if resume else new_run_dir(cfg)
    resume_from = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise RecipeError(f"--resume {run_dir}: not a run folder (no config.yaml)")
        check_resume_config(run_dir, cfg)
    rank, world = rank_and_world()
    is_main = rank == 0
    if world > 1:
        init_process_group()  # for the barrier below (one process joins it later, in the Trainer)
    if is_main:  # models built once, here, before any other rank loads them
        for spec in setup.teacher_specs.values():
            build_missing_teacher(spec)
        if cfg.student.prepare is not None and not setup.student_path.exists():
            prepare_model(cfg.student.prepare, setup.student_path, **cfg.student.prepare_options)
    barrier()
    seed_everything(cfg.seed)  # after the builds, which draw random numbers of their own
    student, tokenizer = load_student(cfg.student, setup.student_path)
    teachers = {env: make_teacher(spec) for env, spec in setup.teacher_specs.items()}
    for env, teacher in teachers.items():
        check_tokenizers(tokenizer, teacher.tokenizer, str(setup.student_path), setup.teacher_specs[env].name)
    teacher_module = teachers[cfg.env.name].model if cfg.objective.estimator == "full" else None
    trainer = Trainer(student, cfg.trainer, cfg.objective, cfg.loss, cfg.trainer.steps, teacher_model=teacher_module)
    policy = POLICY_BACKENDS.get(cfg.policy.backend)(trainer.module, cfg.policy, tokenizer=tokenizer, seed=cfg.seed)
    depth = make_depth_schedule(cfg.depth.mode, **{k: v for k, v in dataclasses.asdict(cfg.depth).items()
                                                   if k not in ("mode", "num_probes")})

    start_step, ledger = 0, Ledger()
    if resume_from is not None:
        state = ckpt.load_loop_state(resume_from)
        trainer.load(resume_from)
        with trainer.gathered_parameters() as student_weights:
            policy.update_weights(student_weights)
        depth.load_state_dict(state["depth"])
        ckpt.load_rng(resume_from)
        start_step = state["step"]
        ledger = Ledger(train_time_offset=state["train_time_s"], wall_time_offset=state["wall_time_s"])
        if is_main:
            dropped = truncate_after_step(run_dir / "metrics.jsonl", start_step)
            print(f"resuming {run_dir} from step {start_step} ({dropped} records past it dropped)")
    elif resume and is_main:
        truncate_after_step(run_dir / "metrics.jsonl", 0)  # killed before its first checkpoint: restart

    writer = tb = None
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        writer = MetricsWriter(run_dir / "metrics.jsonl")
        writer.write({"kind": "start", "name": cfg.name, "method": method_of(cfg.depth.mode, cfg.loss.mode),
                      "seed": cfg.seed, "total_steps": cfg.trainer.steps, "resumed_from_step": start_step,
                      "world_size": world})
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log_eval(result: EvalResult, step: int, kind: str = "eval") -> None:
        if is_main:
            who = "teacher" if kind == "teacher_eval" else f"student at step {step}"
            print(f"{who}: Avg@{result.k} {100 * result.avg_at_k:.1f}% on {result.num_tasks} {result.split} tasks "
                  f"(mean {result.mean_turns:.1f} turns)", flush=True)
            if result.env_failures:
                print(f"WARNING: {who} eval: {result.describe_env_failures()}; they count as lost", flush=True)
        if writer is not None:
            writer.write({"kind": kind, "step": step, "train_time_s": ledger.train_time(),
                          "eval_time_s": ledger.step_phases.get("eval", 0.0), **result.record()})
        if tb is not None:
            tb.add_scalar(f"{kind}/avg_at_{result.k}", result.avg_at_k, step)

    teacher_eval = None
    summary: dict[str, Any] = {"run_dir": str(run_dir), "start_step": start_step}
    with (EnvPool(setup.spec, cfg.env.num_workers, cfg.env.step_timeout_s) as pool,
          open_rollouts(cfg, setup, trainer=trainer, policy=policy, pool=pool, teachers=teachers, depth=depth,
                        ledger=ledger, start_step=start_step) as rollouts):
        if start_step == 0 and cfg.eval.teacher:
            with ledger.phase("eval"):
                teacher_eval = evaluate_teacher(cfg, setup, setup.teacher_specs[cfg.env.name], pool)
            log_eval(teacher_eval, 0, kind="teacher_eval")
            ledger.end_step()
        if start_step == 0 and cfg.eval.at_start:
            with ledger.phase("eval"):
                summary["eval_before"] = run_eval(cfg, setup, pool, policy, 0, ledger)
            log_eval(summary["eval_before"], 0)
            ledger.end_step()

        progress = StepProgress(cfg.trainer.steps, start_step, enabled=is_main)
        for step in range(start_step, cfg.trainer.steps):
            # Probes (full depth) or rollouts at the depth cap, teacher-scored; probes update the controller.
            plan = plan_batch(depth, step, cfg.env.max_turns)
            trajectories = rollouts.take(plan)
            episodes = [e for part in gather_objects([EpisodeSummary.of(t) for t in trajectories]) for e in part]
            if all(e.failed_by_env for e in episodes):  # nothing the agent did: the env cannot run
                raise EnvFailed(f"step {step + 1}: {describe_env_errors(env_errors(episodes), len(episodes))}. "
                                f"Fix the env, then continue the run with --resume {run_dir}")
            if plan.probe:
                probes = [t for part in gather_objects(trajectories) for t in part if not t.failed_by_env]
                depth.update_from_trajectories(probes)
            if step + 1 < cfg.trainer.steps:  # the asynchronous modes generate it while this step trains
                rollouts.prepare(plan_batch(depth, step + 1, cfg.env.max_turns))

            alpha = loss_alpha(step, cfg.trainer.steps, cfg.loss.alpha_start, cfg.loss.alpha_end,
                               cfg.loss.alpha_schedule) if cfg.loss.mode == "progressive" else 0.0
            with ledger.phase("train"):
                train = trainer.step(build_token_batch(trajectories), alpha)  # raises TrainingDiverged
            with ledger.phase("weight_sync"), trainer.gathered_parameters() as student_weights:
                policy.update_weights(student_weights)
                rollouts.publish(student_weights, version=step + 1)

            done = step + 1
            record = step_record(done, ledger, ledger.end_step(), depth, plan.cap, plan.probe, alpha, train, episodes,
                                 sum(e.action_tokens for e in episodes), rollouts.stats())
            if writer is not None:
                writer.write(record)
            if tb is not None:
                for key in ("loss", "mean_kl", "alpha", "rollout_depth_cap", "success_rate", "mean_turns",
                            "deep_turn_share", "train_time_s"):
                    tb.add_scalar(f"train/{key}", record[key], done)
            progress.update(record)

            if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.trainer.steps:
                with ledger.phase("eval"):
                    result = run_eval(cfg, setup, pool, policy, done, ledger)
                log_eval(result, done)
            if done == cfg.trainer.steps:
                with ledger.phase("eval"):
                    summary["eval_after"] = run_eval(cfg, setup, pool, policy, done, ledger)
                log_eval(summary["eval_after"], done)
            if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == cfg.trainer.steps:
                with ledger.phase("checkpoint"):
                    ckpt.save_checkpoint(run_dir, done, trainer, tokenizer, {
                        "train_time_s": ledger.train_time(), "wall_time_s": ledger.wall_time(),
                        "depth": depth.state_dict()}, cfg.checkpoint.keep_last)
            ledger.end_step()  # eval and checkpoint time are in the record's clocks, not its phases
        progress.close()

    summary.update(train_time_s=ledger.train_time(), wall_time_s=ledger.wall_time(), phases=dict(ledger.totals),
                   teacher_eval=teacher_eval, steps=cfg.trainer.steps)
    if writer is not None:
        writer.close()
        print_summary(cfg, summary)
    if tb is not None:
        tb.close()
    return summary


EVAL_CACHE = Path.home() / ".cache" / "turnopd" / "evals"


def evaluate_teacher(cfg: RunConfig, setup: Setup, spec, pool: EnvPool) -> EvalResult:
    """The teacher's Avg@k on the same held-out tasks: the ceiling the student distills toward.
    Cached per (teacher weights, tasks, env and generation settings), so later runs skip it."""
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(spec.model).glob("*.safetensors"))
    key = json.dumps([spec.model, weights, setup.eval_tasks, dataclasses.asdict(cfg.env),
                      dataclasses.asdict(cfg.policy), cfg.eval.k, cfg.eval.temperature, cfg.seed], sort_keys=True)
    cache = EVAL_CACHE / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if cache.is_file():
        return EvalResult.from_record(json.loads(cache.read_text()))
    policy = POLICY_BACKENDS.get(cfg.policy.backend)(spec.model, cfg.policy, dtype=spec.dtype, seed=cfg.seed)
    try:
        result = evaluate(setup.spec, pool, policy, setup.eval_tasks, split=setup.eval_split, env_config=cfg.env,
                          policy_config=cfg.policy, k=cfg.eval.k, temperature=cfg.eval.temperature, seed=cfg.seed)
    finally:
        policy.close()
    if not result.env_failures:  # a score the env cut short is not the teacher's: measure it again next run
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(result.record()))
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `turnopd distill RECIPE`")
