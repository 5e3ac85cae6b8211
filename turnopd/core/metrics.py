"""runs/<name>/metrics.jsonl: one JSON object per line, appended, flushed and fsynced per record.

Record kinds (field "kind"):
- "start": a (re)start of the run: name, method, seed, total_steps, resumed_from_step, world_size,
  models {student, teacher:<env>[, teacher:<env>:adapter]: {path, weights (a fingerprint of the
  weight files, turnopd.models.weights_fingerprint; None for a hub name)}}.
- "train": one optimizer step. step (1-based count of optimizer steps done), train_time_s (training
  wall-clock so far: excludes eval and checkpoint), wall_time_s (everything since the run began),
  phases {phase: seconds this step: rollout or probe, train, weight_sync, trainer_idle; they add
  up to at most step_time_s}, busy {resource: seconds it worked this step: generation, env, teacher,
  trainer; they overlap, see turnopd.core.ledger}, rollout_depth_cap, h_eff, h_cov (None without a probe this
  step), probed (bool), alpha, loss, mean_kl, turn_kl_profile [per turn], deep_turn_share,
  probes (probe episodes this step), h_cov_measured (False: too few probes succeeded, H_cov is the
  fallback's), tokens_generated, tokens_scored (run through the teacher), tokens_trained,
  env_steps, mean_turns, success_rate, invalid_action_rate, skipped (bool),
  turn_signal_profiles {familiarity signal: [per turn, the mean over the trajectories that reached
  it]} (context_logprob, action_logprob, action_entropy: turnopd.algorithm.familiarity; those the
  teacher scored), familiarity_kept_share (the share of the loss weight familiarity.mode weight or
  gate left on the turns, before renormalizing; None with mode none),
  teacher_replicas {teacher: {replica url: requests, failures, up, mean_latency_s this step}}
  (vllm_server teachers; in one_step_off and pool, the generator process's scoring since the
  previous step).
  step_time_s (this step's wall-clock, eval and checkpoint excluded), generator_phases {the generator
  process's startup, idle and weight_sync seconds this step; empty in sync mode},
  pipeline {mode, weight_version (the trainer's), staleness_max, staleness_mean (versions the
  trained trajectories lag it), dropped_stale, queued, generator_restarts} (see turnopd.orchestration.pipeline).
  With world-model rollouts (recipe key world_model.path): world_model_episodes (this step's that a
  world model answered; success_rate counts their model-declared wins, env_steps only the real env's
  turns), world_model_steps (the model's), world_model_verdict_steps (the model's steps judging
  real episodes, world_model.verdict), world_model_no_verdict (real episodes it gave no usable
  verdict on, left out of the bias), success_rate_real (the real episodes'), success_rate_debiased and its _stderr, world_model_bias (Online Debiasing, see
  turnopd.orchestration.distill.world_model_record); busy also holds world_model.
- "eval": step (optimizer steps done when evaluated), train_time_s (training clock then), split,
  k, avg_at_k (0..1), per_type {task type: avg}, num_tasks, mean_turns, eval_time_s.
  per_task {task id: successes / k} (for intervals paired over tasks).
- "final_eval": the same fields, for the sampled Avg@eval.final_k of the final student.
- "teacher_eval": the same fields for the teacher on the same tasks (the ceiling), at step 0.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from turnopd.core.faults import naming_a_full_disk

STEP_KINDS = ("train", "eval", "final_eval", "teacher_eval")  # records that belong to a step


class MetricsWriter:
    """Appends records; each write is one complete line, fsynced, so a crash loses at most the record
    being written and never leaves a torn line behind a complete one. A write the disk has no room
    for is cut back off the file (the file ends with the record before it) and raises DiskFull."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # unbuffered: nothing held back

    def write(self, record: dict[str, Any]) -> None:
        line = memoryview((json.dumps(record, allow_nan=True) + "\n").encode())
        start = os.fstat(self._fd).st_size
        what = (f"its {record.get('kind')} record of step {record.get('step', 0)} was not written (the file ends "
                "with the record before it)")
        with naming_a_full_disk(self.path, what, self.path.parent):
            try:
                while line:
                    line = line[os.write(self._fd, line):]
                os.fsync(self._fd)
            except OSError:
                os.ftruncate(self._fd, start)  # no torn line: the next writer appends after a complete one
                raise

    def close(self) -> None:
        os.close(self._fd)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete records of a metrics.jsonl (a run may still be writing it). A torn or
    unparsable line is skipped with a warning naming the file and line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{lineno}: skipping a truncated or corrupt metrics line", stacklevel=2)
    return records


def truncate_after_step(path: str | os.PathLike[str], step: int) -> int:
    """On resume from a checkpoint at `step`: drop the records the continued run writes again, so
    that the file reads like an uninterrupted run's (plus one "start" record per resume): train and
    evaluation records past that step, and at step 0 (a run killed before its first checkpoint
    starts over) its step-0 evaluations too; a torn line goes as well. Returns records dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    records = read_metrics(path)
    kept = [r for r in records if r.get("kind") not in STEP_KINDS or r.get("step", 0) < step
            or (r.get("step", 0) == step and step > 0)]
    tmp = path.with_suffix(".jsonl.tmp")
    what = f"its records past step {step} could not be dropped (the file is unchanged)"
    with naming_a_full_disk(path, what, path.parent):
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for r in kept:
                    f.write(json.dumps(r, allow_nan=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, path)
    return len(records) - len(kept)
