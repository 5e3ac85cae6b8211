"""runs/<name>/metrics.jsonl: one JSON object per line, appended, flushed and fsynced per record.

Record kinds (field "kind"):
- "start": a (re)start of the run: name, method, seed, total_steps, resumed_from_step, world_size,
  models {student, teacher:<env>[, teacher:<env>:adapter]: {path, weights (a fingerprint of the
  weight files, turnopd.models.weights_fingerprint; None for a hub name)}}, code {version (the package's),
  source (a fingerprint of its files, turnopd.core.source.code_fingerprint)}.
- "train": one optimizer step: the fields of StepRecord (below).
- "eval": step (optimizer steps done when evaluated), train_time_s (training clock then), split,
  k, avg_at_k (0..1), per_type {task type: avg}, num_tasks, mean_turns, invalid_action_rate (invalid actions
  over the turns played; absent before 2026-12-07), eval_time_s.
  per_task {task id: successes / k} (for intervals paired over tasks).
- "final_eval": the same fields, for the sampled Avg@eval.final_k of the final student.
- "teacher_eval": the same fields for the teacher on the same tasks (the ceiling), at step 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnopd.core.faults import naming_a_full_disk

STEP_KINDS = ("train", "eval", "final_eval", "teacher_eval", "budget_reached")  # records that belong to a step
# what a training budget (trainer.budget) may be counted in: the training clock, or a work measure
# of the step records (machine-independent)
WORK_UNITS = ("train_time_s", "env_steps", "tokens_generated", "tokens_trained")


@dataclass
class StepRecord:
    """A "train" record: one optimizer step, as the loop writes it and `turnopd frontier` reads it.
    Fields a run of an older version did not write read back as their defaults (from_json)."""

    step: int  # optimizer steps done (1-based)
    train_time_s: float  # training wall-clock so far: excludes eval and checkpoint; continues across resumes
    wall_time_s: float = 0.0  # everything since the run began
    step_time_s: float = 0.0  # this step's wall-clock, eval and checkpoint excluded
    # seconds this step per loop phase: rollout or probe, train, weight_sync, trainer_idle (they add up
    # to at most step_time_s), and per resource busy: generation, env, world_model, teacher, trainer
    # (they overlap; turnopd.core.ledger)
    phases: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)
    generator_phases: dict[str, float] = field(default_factory=dict)  # the generator process's startup, idle,
    # weight_sync seconds this step (empty in sync mode)
    # the train phase's parts: teacher (its in-process forward), forward_backward, optimizer (seconds)
    train_parts: dict[str, float] = field(default_factory=dict)
    # mode, weight_version (the trainer's), staleness_max, staleness_mean (versions the trained
    # trajectories lag it), dropped_stale, queued, generator_restarts, judge (turnopd.orchestration.pipeline)
    pipeline: dict[str, Any] = field(default_factory=dict)
    # the turn budget: the cap of the step's non-probe episodes (the horizon on a probe step), whether
    # the depth controller was updated (probed), how many probes played, and the update's H_eff, H_cov
    # (None without an update) and whether H_cov was measured (False: too few probes won, the fallback's)
    rollout_depth_cap: int = 0
    probed: bool = False
    probes: int = 0
    h_eff: float | None = None
    h_cov: float | None = None
    h_cov_measured: bool | None = None
    alpha: float = 0.0  # the progressive loss's alpha (0 for the other loss modes)
    loss: float = 0.0
    grad_norm: float | None = None
    lr: float | None = None
    mean_kl: float = 0.0
    turn_kl_profile: list[float] = field(default_factory=list)  # mean KL per turn
    deep_turn_share: float = 0.0  # the loss weight on the deep third of turns
    skipped: bool = False  # a NaN/inf step, not applied
    optimizer_updates: int = 1  # updates this step took (trainer.turn_rows_per_update splits a step into several)
    # per familiarity signal the teacher scored (context_logprob, action_logprob, action_entropy:
    # turnopd.algorithm.familiarity), its mean per turn over the trajectories that reached it
    turn_signal_profiles: dict[str, list[float]] = field(default_factory=dict)
    familiarity_kept_share: float | None = None  # weight share familiarity.mode kept (None: mode none)
    # the work beside the clock
    tokens_generated: int = 0
    tokens_scored: int = 0  # run through the teacher
    tokens_trained: int = 0
    env_steps: int = 0  # turns played in the real env (a world model's are not the env's)
    episodes: int = 0
    mean_turns: float = 0.0
    success_rate: float = 0.0
    # the won and the other episodes' mean turns (None: none such; an episode the env ended with an
    # error is neither; one the depth cap stopped is not won): whether wins and losses get shorter
    mean_turns_won: float | None = None
    mean_turns_lost: float | None = None
    truncated_rate: float = 0.0
    invalid_action_rate: float = 0.0
    # memory high-water marks since the run's process began, MiB (turnopd.core.device.peak_memory_mib):
    # host (this process and the live ones it started), cuda on a GPU; a run's peak is its last record's
    peak_memory_mib: dict[str, float] = field(default_factory=dict)
    env_failures: int = 0  # episodes the env ended itself, and their errors by message
    env_errors: dict[str, int] = field(default_factory=dict)
    # an env that shows screenshots (None otherwise): the screenshots in the step's prompts (keys) and
    # distinct ones (stored), the bytes the keys took (key_bytes) against the uint8 screens (screen_bytes)
    # and the pixel_values the student took (pixel_value_bytes: what sending pixels with the trajectories
    # would move), the images fetched from the store for generation and training (fetched_images),
    # the store's size before it was freed (store_bytes), and whether the batch was dropped for a lost
    # screenshot (dropped, missing)
    screenshots: dict[str, Any] | None = None
    # {teacher: {replica url: requests, failures, up, mean_latency_s this step}} (vllm_server teachers;
    # in one_step_off and pool, the generator process's scoring since the previous step)
    teacher_replicas: dict[str, Any] = field(default_factory=dict)
    # a multi-env run (recipe key envs; None otherwise, and left out of the record): per env, its
    # depth cap, probes, episodes, mean turns and success rate this step, and its controller's H_eff,
    # H_cov and H_cov_measured when its probes updated it
    per_env: dict[str, dict[str, Any]] | None = None
    # world-model rollouts (world_model.path; None otherwise): the step's model episodes (success_rate
    # counts their model-declared wins), their model steps, the model steps its verdicts on real episodes
    # took (world_model.verdict), real episodes without a usable verdict, the real episodes' success
    # rate, and Online Debiasing's debiased rate, its standard error and the measured bias; with
    # world_model.debias=isotonic, whether the map is fitted yet and its last refit's centred squared
    # residual before and after it (the debiased rate: the model episodes' mean calibrated score, no
    # standard error); with denoise=anchor_weight, the anchor groups' weight and the step's anchor groups
    world_model_episodes: int | None = None
    world_model_steps: int | None = None
    world_model_verdict_steps: int | None = None
    world_model_no_verdict: int | None = None
    success_rate_real: float | None = None
    success_rate_debiased: float | None = None
    success_rate_debiased_stderr: float | None = None
    world_model_bias: float | None = None
    world_model_calibrated: bool | None = None
    world_model_bias_before: float | None = None
    world_model_bias_after: float | None = None
    world_model_anchor_weight: float | None = None
    world_model_anchor_groups: int | None = None
    kind: str = "train"

    def to_json(self) -> dict[str, Any]:
        """The record as metrics.jsonl holds it (the world-model fields only in a world-model run's, per_env
        only in a multi-env run's)."""
        record = dataclasses.asdict(self)
        if self.per_env is None:
            del record["per_env"]
        if self.world_model_episodes is None:
            for name in WORLD_MODEL_FIELDS:
                del record[name]
        return {"kind": record.pop("kind"), **record}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StepRecord:
        """A saved train record (unknown keys, of other versions, left out)."""
        return cls(**{name: record[name] for name in FIELD_NAMES if name in record})


@dataclass
class WorkSpent:
    """A run's training clock and cumulative work after its last step (WORK_UNITS), from its step
    records; checkpoints keep it, so a resumed run goes on counting."""

    train_time_s: float = 0.0
    env_steps: int = 0
    tokens_generated: int = 0
    tokens_trained: int = 0

    def add(self, record: StepRecord) -> None:
        self.train_time_s = record.train_time_s  # a clock: cumulative already
        self.env_steps += record.env_steps
        self.tokens_generated += record.tokens_generated
        self.tokens_trained += record.tokens_trained


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(StepRecord))
WORLD_MODEL_FIELDS = FIELD_NAMES[FIELD_NAMES.index("world_model_episodes"):FIELD_NAMES.index("kind")]


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
