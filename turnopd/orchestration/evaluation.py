"""A distillation run's evaluations: the student's Avg@k on the held-out tasks (at the start, every
`eval.every` steps, at the end, and a sampled Avg@eval.final_k of the final student) and the
teacher's on the same tasks (the ceiling, cached across runs)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envs.pool import EnvPool
from teachers import TeacherSpec
from turnopd.config import PromptConfig, RunConfig
from turnopd.core.distributed import gather_objects, rank_and_world
from turnopd.core.progress import EpisodeProgress
from turnopd.core.types import EpisodeSummary, env_errors
from turnopd.loaders.hf_models import load_model
from turnopd.orchestration.pipeline import env_parts
from turnopd.orchestration.preflight import Setup
from turnopd.orchestration.run_log import RunLog
from turnopd.rollout import Policy, make_policy
from turnopd.rollout.eval import EvalResult, avg_at_k, evaluate, invalid_action_rate

EVAL_CACHE = Path.home() / ".cache" / "turnopd" / "evals"


def run_eval(cfg: RunConfig, setup: Setup, pool: EnvPool, policy: Policy, step: int, k: int | None = None
             ) -> EvalResult:
    """Avg@k (k: eval.k by default) on this rank's share of the eval tasks, combined over ranks."""
    rank, world = rank_and_world()
    k = k or cfg.eval.k
    shard = setup.eval_tasks[rank::world]  # empty on the last ranks when there are fewer tasks than ranks
    label = f"eval at step {step}" + (f" (rank 0's {len(shard)} of {len(setup.eval_tasks)} tasks)" if world > 1 else "")
    with EpisodeProgress(label, len(shard) * k, enabled=rank == 0) as progress:
        local = evaluate(setup.spec, pool, policy, shard, split=setup.eval_split, env_config=cfg.env,
                         policy_config=cfg.policy, k=k, temperature=cfg.eval.temperature, seed=cfg.seed + step,
                         on_episode=progress.episode_done, prompt=cfg.prompt).trajectories if shard else []
    episodes = [e for part in gather_objects([EpisodeSummary.of(t) for t in local]) for e in part]
    overall, per_type, per_task = avg_at_k(episodes, k)
    return EvalResult(setup.eval_split, k, overall, per_type, len(setup.eval_tasks),
                      sum(e.depth for e in episodes) / len(episodes), env_errors(episodes), per_task,
                      invalid_action_rate=invalid_action_rate(episodes))


def over_envs(cfg: RunConfig, setup: Setup, evaluation: Callable[[RunConfig, Setup, str], EvalResult]
              ) -> EvalResult:
    """`evaluation(cfg, setup, env)` of the run's env, or of each env of a multi-env run (with the recipe
    as that env sees it and its own held-out tasks), combined (EvalResult.mixed)."""
    results = {env: evaluation(view, part, env) for env, (view, part) in env_parts(cfg, setup).items()}
    return EvalResult.mixed(results) if cfg.envs else results[cfg.env.name]


def student_eval(cfg: RunConfig, setup: Setup, pools: dict[str, EnvPool], policy: Policy, step: int,
                 k: int | None = None) -> EvalResult:
    """The student's Avg@k (run_eval) on every env of the run, each in its own pool."""
    return over_envs(cfg, setup, lambda view, part, env: run_eval(view, part, pools[env], policy, step, k))


def evaluate_at_start(cfg: RunConfig, setup: Setup, pools: dict[str, EnvPool], policy: Policy,
                      log: RunLog) -> dict[str, Any]:
    """Step 0 of a new run: the teachers (eval.teacher: each on its env) and the student before training
    (eval.at_start)."""
    results: dict[str, Any] = {}
    if cfg.eval.teacher:
        results["teacher_eval"] = log.evaluate("teacher_eval", 0, lambda: over_envs(
            cfg, setup, lambda view, part, env: evaluate_teacher(view, part, part.teacher_specs[env], pools[env])))
    if cfg.eval.at_start:
        results["eval_before"] = log.evaluate("eval", 0, lambda: student_eval(cfg, setup, pools, policy, 0))
    log.ledger.end_step()  # their time is not step 1's
    return results


def evaluate_on_schedule(cfg: RunConfig, setup: Setup, pools: dict[str, EnvPool], policy: Policy, log: RunLog,
                         done: int, last: bool) -> dict[str, Any]:
    """After `done` steps: every eval.every steps, and after the `last` step (all steps, or the
    training budget reached) the student's Avg@eval.k and, with eval.final_k, a sampled
    Avg@final_k beside the greedy curve."""
    if last:
        results = {"eval_after": log.evaluate("eval", done, lambda: student_eval(cfg, setup, pools, policy, done))}
        if cfg.eval.final_k:
            log.evaluate("final_eval", done,
                         lambda: student_eval(cfg, setup, pools, policy, done, k=cfg.eval.final_k))
        return results
    if cfg.eval.every and done % cfg.eval.every == 0:
        log.evaluate("eval", done, lambda: student_eval(cfg, setup, pools, policy, done))
    return {}


def teacher_policy(cfg: RunConfig, spec: TeacherSpec) -> Policy:
    """The teacher as a policy of the recipe's backend, to play episodes itself (a LoRA teacher plays
    with its adapter; vLLM serves it as a LoRA adapter)."""
    if spec.adapter:
        model, tokenizer = load_model(spec.model, spec.dtype, adapter=spec.adapter)
        return make_policy(cfg.policy, model, tokenizer=tokenizer, dtype=spec.dtype, seed=cfg.seed)
    return make_policy(cfg.policy, spec.model, dtype=spec.dtype, seed=cfg.seed)


def evaluate_teacher(cfg: RunConfig, setup: Setup, spec: TeacherSpec, pool: EnvPool) -> EvalResult:
    """The teacher's Avg@k on the same held-out tasks: the ceiling the student distills toward.
    Cached per (teacher weights, tasks, env and generation settings), so later runs skip it."""
    def weights(folder: str) -> list:
        return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(folder).glob("*.safetensors"))

    adapter = [spec.adapter, weights(spec.adapter)] if spec.adapter else []
    # the prompt section enters the key only when set, so that the caches of history_block runs stay valid
    prompt = [dataclasses.asdict(cfg.prompt)] if cfg.prompt != PromptConfig() else []
    env = {k: v for k, v in dataclasses.asdict(cfg.env).items() if k not in ("pool", "ray")}  # not where it runs
    key = json.dumps([spec.model, weights(spec.model), setup.eval_tasks, env,
                      dataclasses.asdict(cfg.policy), cfg.eval.k, cfg.eval.temperature, cfg.seed, *adapter, *prompt],
                     sort_keys=True)
    cache = EVAL_CACHE / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if cache.is_file():
        return EvalResult.from_record(json.loads(cache.read_text()))
    policy = teacher_policy(cfg, spec)
    try:
        with EpisodeProgress("teacher eval", len(setup.eval_tasks) * cfg.eval.k,
                             enabled=rank_and_world()[0] == 0) as progress:
            result = evaluate(setup.spec, pool, policy, setup.eval_tasks, split=setup.eval_split, env_config=cfg.env,
                              policy_config=cfg.policy, k=cfg.eval.k, temperature=cfg.eval.temperature,
                              seed=cfg.seed, on_episode=progress.episode_done, prompt=cfg.prompt)
    finally:
        policy.close()
    if not result.env_failures:  # a score the env cut short is not the teacher's: measure it again next run
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(result.record()))
    return result
