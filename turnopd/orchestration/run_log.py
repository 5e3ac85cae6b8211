"""What a run writes, on rank 0 only: metrics.jsonl (the run's record: a start record per (re)start,
a StepRecord per optimizer step, an eval record per evaluation), the same records to each tracker of
`tracking` (turnopd.core.tracking), the lines a person reads and, at the end, frontier.png."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnopd.algorithm.controllers import DepthSchedule, EnvDepths
from turnopd.algorithm.objective import turn_kl_profile
from turnopd.algorithm.world_model_corrections import debiased_mean
from turnopd.analysis.plot import plot_run
from turnopd.config import RunConfig, to_yaml
from turnopd.core.device import peak_memory_mib, run_device
from turnopd.core.distributed import rank_and_world
from turnopd.core.faults import naming_a_full_disk
from turnopd.core.ledger import Ledger
from turnopd.core.methods import method_of
from turnopd.core.metrics import MetricsWriter, StepRecord
from turnopd.core.pixels import KEY_CHARS
from turnopd.core.source import code_build
from turnopd.core.tracking import TRACKERS, TrackedRun
from turnopd.core.types import EpisodeSummary, Trajectory, env_errors
from turnopd.loaders.screens import ScreenPixels
from turnopd.models import folder_builds
from turnopd.orchestration.pipeline import BatchPlan, MixturePlan, PipelineStats, per_env_fields
from turnopd.orchestration.preflight import Setup
from turnopd.rollout.eval import EvalResult
from turnopd.rollout.world_model_pool import trace_of
from turnopd.trainer.trainer import StepResult


class RunLog:
    """The run's record (module docstring); every rank holds one, rank 0 writes."""

    def __init__(self, cfg: RunConfig, run_dir: Path, ledger: Ledger, start_step: int, setup: Setup):
        rank, world = rank_and_world()
        self.ledger, self.is_main, self.run_dir, self.step = ledger, rank == 0, run_dir, start_step
        self.writer, self.trackers = None, []
        if not self.is_main:
            return
        with naming_a_full_disk(run_dir / "config.yaml", "the run's config.yaml was not written", run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.writer = MetricsWriter(run_dir / "metrics.jsonl")
        self.writer.write({"kind": "start", "name": cfg.name, "method": method_of(dataclasses.asdict(cfg)),
                           "seed": cfg.seed, "total_steps": cfg.trainer.steps, "resumed_from_step": start_step,
                           "world_size": world, "models": model_builds(setup),
                           "code": code_build()})
        tracked = TrackedRun(run_dir, cfg.tracker.run_name or cfg.name, dataclasses.asdict(cfg), start_step, cfg.tracker)
        self.trackers = [TRACKERS.get(name)(tracked) for name in cfg.tracking]

    def train(self, record: StepRecord) -> None:
        self.step = record.step
        if self.writer is None:
            return
        fields = record.to_json()
        self.writer.write(fields)
        for tracker in self.trackers:
            tracker.log_record(fields, record.step)

    def budget_reached(self, step: int, unit: str, amount: float, spent: float) -> None:
        """The run ends at `step`: its trainer.budget of `amount` `unit` was reached (`spent`)."""
        if self.is_main:
            print(f"training budget reached at step {step}: {spent:g} of {amount:g} {unit}", flush=True)
            self.writer.write({"kind": "budget_reached", "step": step, "unit": unit, "amount": amount, "spent": spent})

    def evaluate(self, kind: str, step: int, evaluation: Callable[[], EvalResult]) -> EvalResult:
        """Run an evaluation (on every rank: it gathers) and record it (timed_evaluation's clocks)."""
        result, train_time_s, eval_time_s = timed_evaluation(self.ledger, evaluation)
        self._write_eval(kind, step, result, train_time_s, eval_time_s)
        return result

    def _write_eval(self, kind: str, step: int, result: EvalResult, train_time_s: float, eval_time_s: float) -> None:
        if not self.is_main:
            return
        who = "teacher" if kind == "teacher_eval" else f"student at step {step}"
        envs = "".join(f"; {env} {100 * r.avg_at_k:.1f}% on {r.num_tasks}" for env, r in result.per_env.items())
        invalid = "" if result.invalid_action_rate is None else f", {100 * result.invalid_action_rate:.1f}% invalid actions"
        print(f"{who}: Avg@{result.k} {100 * result.avg_at_k:.1f}% on {result.num_tasks} {result.split} tasks "
              f"(mean {result.mean_turns:.1f} turns{invalid}{envs})", flush=True)
        if result.env_failures:
            print(f"WARNING: {who} eval: {result.describe_env_failures()}; they count as lost", flush=True)
        record = {"kind": kind, "step": step, "train_time_s": train_time_s, "eval_time_s": eval_time_s,
                  **result.record()}
        self.writer.write(record)
        for tracker in self.trackers:
            tracker.log_eval(kind, record, step)

    def finish(self) -> None:
        """Once the run has trained: its accuracy-vs-training-time plot, frontier.png, to every tracker."""
        if self.is_main:
            plot = plot_run(self.run_dir)
            for tracker in self.trackers:
                tracker.log_image("frontier", plot, self.step)

    def close(self) -> None:
        for out in (self.writer, *self.trackers):
            if out is not None:
                out.close()


def timed_evaluation(ledger: Ledger, evaluation: Callable[[], EvalResult]) -> tuple[EvalResult, float, float]:
    """The evaluation's result, the training clock when it began (the step's: an evaluation is off the
    training clock) and its own duration: it runs in the ledger's eval phase."""
    train_time_s, before = ledger.train_time(), ledger.step_phases.get("eval", 0.0)
    with ledger.phase("eval"):
        result = evaluation()
    return result, train_time_s, ledger.step_phases["eval"] - before


def model_builds(setup: Setup) -> dict[str, dict[str, Any]]:
    """Which weights the run distills (the start record's `models`): each model's folder and its
    weights' fingerprint, so that `turnopd frontier` tells runs of two builds of one folder apart."""
    models = {"student": setup.student_path, **{f"teacher:{env}": spec.model for env, spec in setup.teacher_specs.items()},
              **{f"teacher:{env}:adapter": spec.adapter for env, spec in setup.teacher_specs.items() if spec.adapter}}
    return folder_builds(models)


def step_record(step: int, ledger: Ledger, phases: dict[str, float], depth: DepthSchedule | EnvDepths,
                plan: BatchPlan | MixturePlan, updated: bool, alpha: float, train: StepResult, episodes: list[EpisodeSummary],
                pipeline: PipelineStats, teacher_replicas: dict[str, Any]) -> StepRecord:
    """One optimizer step's record. The work measures beside the clock: tokens generated, scored by
    the teacher and trained, env steps."""
    diagnostics = depth.diagnostics() if updated else {}
    turns = sum(e.depth for e in episodes)
    traces = [trace_of(e) for e in episodes]
    world_model = any(t.played or t.predicted_success is not None for t in traces)
    return StepRecord(
        step=step, train_time_s=ledger.train_time(), wall_time_s=ledger.wall_time(),
        step_time_s=ledger.last_step_time_s, phases=phases, busy=ledger.last_busy,
        generator_phases=ledger.last_generator_phases, train_parts=train.train_parts,
        pipeline=dataclasses.asdict(pipeline),
        rollout_depth_cap=plan.cap, probed=plan.is_probe_step, probes=plan.probes, h_eff=diagnostics.get("h_eff"),
        h_cov=diagnostics.get("h_cov"), h_cov_measured=diagnostics.get("h_cov_measured"), alpha=alpha,
        loss=train.loss, grad_norm=train.grad_norm, lr=train.lr, mean_kl=train.mean_kl,
        turn_kl_profile=turn_kl_profile(train.turn_kl), deep_turn_share=train.deep_turn_share,
        skipped=train.skipped, optimizer_updates=train.optimizer_updates,
        turn_signal_profiles={name: turn_kl_profile(turns) for name, turns in train.turn_signals.items()},
        familiarity_kept_share=train.familiarity_kept_share,
        tokens_generated=sum(e.action_tokens for e in episodes), tokens_scored=sum(e.scored_tokens for e in episodes),
        tokens_trained=train.tokens_trained,
        env_steps=sum(e.depth for e, t in zip(episodes, traces, strict=True) if not t.played),  # not a world model's
        episodes=len(episodes), mean_turns=turns / len(episodes),
        success_rate=sum(e.success for e in episodes) / len(episodes),
        mean_turns_won=mean_turns_of(episodes, won=True), mean_turns_lost=mean_turns_of(episodes, won=False),
        truncated_rate=sum(e.truncated for e in episodes) / len(episodes),
        invalid_action_rate=sum(e.invalid_actions for e in episodes) / max(turns, 1),
        peak_memory_mib=peak_memory_mib(run_device()),
        env_failures=sum(e.failed_by_env for e in episodes), env_errors=env_errors(episodes),
        teacher_replicas=teacher_replicas, **(world_model_fields(episodes) if world_model else {}),
        per_env=per_env_fields(depth, plan, updated, episodes) if isinstance(plan, MixturePlan) else None)


def screenshot_fields(screens: ScreenPixels, trajectories: list[Trajectory], train: StepResult) -> dict[str, Any]:
    """The step's StepRecord.screenshots (this rank's): what its prompts' screenshot keys stood for and
    what was fetched for them, before the store is freed."""
    keys = [key for traj in trajectories for turn in traj.turns for key in turn.image_keys]
    counts = screens.take_counts()
    per_screen = counts.store_bytes / counts.images if counts.images else 0
    per_pixel_values = counts.pixel_value_bytes / counts.images if counts.images else 0
    return {"keys": len(keys), "stored": len(set(keys)), "key_bytes": len(keys) * KEY_CHARS,
            "screen_bytes": round(len(keys) * per_screen), "pixel_value_bytes": round(len(keys) * per_pixel_values),
            "fetched_images": counts.images, "store_bytes": screens.store.stats()["bytes"],
            "dropped": train.dropped, "missing": train.missing_images}


def mean_turns_of(episodes: list[EpisodeSummary], won: bool) -> float | None:
    """The mean turns of the won (or the other) episodes, those the env ended with an error left out;
    None when there is none."""
    turns = [e.depth for e in episodes if e.success == won and not e.failed_by_env]
    return sum(turns) / len(turns) if turns else None


def world_model_fields(episodes: list[EpisodeSummary]) -> dict[str, Any]:
    """A world-model run's success signals: the step's success rate (success_rate) mixes the
    model's verdicts on its own episodes with real outcomes; success_rate_real is the real episodes'
    alone, success_rate_debiased the model episodes' corrected by the bias measured on the real
    ones (Online Debiasing: the model's verdict on each real episode against its outcome);
    world_model_verdict_steps the model steps those verdicts took (a replay's are an episode's),
    world_model_no_verdict the real episodes left out of the bias (the model gave no usable answer)."""
    played = [(e, trace_of(e)) for e in episodes if not e.env_error]
    model = [float(e.success) for e, t in played if t.played]
    real = [(e, t) for e, t in played if not t.played and t.predicted_success is not None]
    traces = [trace_of(e) for e in episodes]
    fields: dict[str, Any] = {"world_model_episodes": sum(t.played for t in traces),
                              "world_model_steps": sum(e.depth for e, t in zip(episodes, traces, strict=True) if t.played),
                              "world_model_verdict_steps": sum(t.verdict_steps for t in traces),
                              "world_model_no_verdict": sum(not t.played and t.predicted_success is None
                                                            for _, t in played),
                              "success_rate_real": sum(e.success for e, _ in real) / len(real) if real else None}
    if real:
        debiased = debiased_mean(model, [float(e.success) for e, _ in real], [t.predicted_success for _, t in real])
        fields.update(success_rate_debiased=debiased.estimate, success_rate_debiased_stderr=debiased.stderr,
                      world_model_bias=debiased.bias)
    return fields
