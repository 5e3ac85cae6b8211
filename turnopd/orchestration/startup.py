"""Opening a distillation run: check the recipe's setup, build the models a run needs once, load
them, and restore the last checkpoint of a resumed run. `open_run` returns the DistillRun the loop
(turnopd.orchestration.distill.train) trains."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from envs.base import shows_screenshots
from teachers import Teacher, check_tokenizers, make_teachers
from teachers.vllm_server import check_server
from turnopd.algorithm.controllers import DepthSchedule, EnvDepths
from turnopd.algorithm.objective import ESTIMATORS
from turnopd.algorithm.token_alignment import vocab_map
from turnopd.config import RecipeError, RunConfig
from turnopd.core import checkpoint as ckpt
from turnopd.core.distributed import barrier, gather_objects, rank_and_world
from turnopd.core.ledger import Ledger
from turnopd.core.metrics import WorkSpent, truncate_after_step
from turnopd.core.pixels import PixelStore, default_pixel_root
from turnopd.loaders.hf_models import load_student
from turnopd.loaders.screens import ScreenPixels, attach_run_screens
from turnopd.models import prepare_model
from turnopd.models.screen_reader import reader_folder, reader_for
from turnopd.orchestration.outcomes import Outcomes
from turnopd.orchestration.pipeline import make_depth
from turnopd.orchestration.preflight import Setup, check_setup, run_dir_for
from turnopd.orchestration.run_log import RunLog
from turnopd.orchestration.sft import build_missing_teacher
from turnopd.rollout import Policy, make_policy
from turnopd.trainer import Trainer
from turnopd.trainer.deepspeed_setup import init_process_group


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class DistillRun:
    """An opened distillation run: its recipe and setup, the models built and loaded, and where it starts."""

    cfg: RunConfig
    setup: Setup
    run_dir: Path
    start_step: int
    ledger: Ledger
    log: RunLog
    trainer: Trainer
    tokenizer: Any
    policy: Policy
    teachers: dict[str, Teacher]
    depth: DepthSchedule | EnvDepths  # a multi-env run's: one per env
    spent: WorkSpent  # the training clock and work so far (trainer.budget counts in them)
    outcomes: Outcomes  # the outcome rewards' state (WMRL's corrections)
    screens: ScreenPixels | None = None  # an env that shows screenshots: the student's pixels, by key

    @property
    def budget_reached(self) -> bool:
        budget = self.cfg.trainer.budget
        return budget is not None and getattr(self.spent, budget.unit) >= budget.amount


def build_missing_models(cfg: RunConfig, setup: Setup) -> None:
    """On rank 0, before any rank loads them: teachers trained by their sft_recipe, the student built
    by its preparation and its screen reader, where their folders do not exist yet."""
    if rank_and_world()[0] == 0:
        for spec in setup.teacher_specs.values():
            build_missing_teacher(spec)
        if cfg.student.prepare is not None and not setup.student_path.exists():
            prepare_model(cfg.student.prepare, setup.student_path, **cfg.student.prepare_options)
        reader_folder(cfg.student)
    barrier()


def save_checkpoint(run: DistillRun, step: int) -> None:
    """The trainer's state and the loop's (clocks, depth controller) after `step` optimizer steps."""
    # a vision-language student's processor saves its tokenizer and image settings: a complete model folder
    ckpt.save_checkpoint(run.run_dir, step, run.trainer, (run.screens and run.screens.processor) or run.tokenizer, {
        "train_time_s": run.ledger.train_time(), "wall_time_s": run.ledger.wall_time(),
        "depth": run.depth.state_dict(), "spent": dataclasses.asdict(run.spent),
        "outcomes": run.outcomes.state_dict()}, run.cfg.checkpoint.keep_last)


def load_models(cfg: RunConfig, setup: Setup) -> tuple[Trainer, Any, Policy, dict[str, Teacher]]:
    """The student in its trainer, its tokenizer, the rollout policy over the trained module, and the
    teachers (tokenizers checked against the student's)."""
    student, tokenizer = load_student(setup.student_path, cfg.student.dtype, cfg.student.lora)
    if cfg.student.lora is not None and rank_and_world()[0] == 0:
        trainable, total = student.get_nb_trainable_parameters()
        print(f"training a LoRA adapter (rank {cfg.student.lora.rank}): {trainable / 1e6:.2f}M of "
              f"{total / 1e6:.1f}M parameters", flush=True)
    teachers = make_teachers(setup.teacher_specs)
    for env, teacher in teachers.items():
        if cfg.objective.tokenizers == "match":
            check_tokenizers(tokenizer, teacher.tokenizer, str(setup.student_path), setup.teacher_specs[env].name)
        elif teacher.tokenizer is None:  # cross: the turns are rendered for it in its own tokenizer
            raise RecipeError(f"recipe key 'objective.tokenizers': cross, and teacher {teacher.name} has no tokenizer "
                              "here to render its turns with (a vllm_server teacher reads spec.tokenizer or "
                              "spec.model: name a local tokenizer folder)")
    estimator = ESTIMATORS.get(cfg.objective.estimator)
    teacher_model = None
    if estimator.needs_teacher_model:  # a multi-env run's by env: each reads its env's
        teacher_model = {env: t.model for env, t in teachers.items()} if cfg.envs else teachers[cfg.env.name].model
    # topk_cross maps one teacher's vocabulary (several teachers with it are refused at the recipe check)
    maps = vocab_map(tokenizer, next(iter(teachers.values())).tokenizer) if estimator.needs_vocab_map else None
    trainer = Trainer(student, cfg.trainer, cfg.objective, cfg.loss, cfg.trainer.steps, teacher_model=teacher_model,
                      familiarity_cfg=cfg.familiarity, vocab=len(tokenizer), vocab_map=maps)
    policy = make_policy(cfg.policy, trainer.module, tokenizer=tokenizer, seed=cfg.seed)
    return trainer, tokenizer, policy, teachers


def run_pixel_store(cfg: RunConfig, spec: Any, run_dir: Path) -> None:
    """The env's pixel store for this run, emptied: by default a folder named after the run folder on
    the node's shared memory (a resumed run finds and frees what its killed self left), else the
    recipe's env.options.pixel_store; with several ranks, a folder of each rank's own in it (a rank
    frees what its own episodes no longer hold, which it cannot tell of another's)."""
    if not shows_screenshots(spec):
        return
    if "pixel_store" not in cfg.env.options:
        digest = hashlib.blake2b(str(run_dir.resolve()).encode(), digest_size=6).hexdigest()
        spec.pixel_store = PixelStore(default_pixel_root(f"{run_dir.name}-{digest}"))
    rank, world = rank_and_world()
    if world > 1:
        spec.pixel_store = PixelStore(spec.pixel_store.root / f"rank{rank}")
    spec.pixel_store.clear()


SHARED_MARKER = ".shared-by-every-rank"


def check_shared_run_dir(run_dir: Path) -> None:
    """Every rank writes into the run folder (rank 0 creates it and renames its checkpoints), so with
    several ranks, across nodes, it must be one folder on a filesystem they all mount. Rank 0 writes
    a marker with a fresh token there; a rank that does not read it back refuses, and so do all (a
    collective: every rank calls it)."""
    rank, _ = rank_and_world()
    marker = run_dir / SHARED_MARKER
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(secrets.token_hex(8))
    # after rank 0 wrote it: its token and where its run folder is
    token, where = gather_objects((marker.read_text(), str(run_dir.absolute())) if rank == 0 else None)[0]
    sees = gather_objects(marker.is_file() and marker.read_text() == token)
    barrier()
    if rank == 0:
        marker.unlink()
    blind = [r for r, ok in enumerate(sees) if not ok]
    if blind:
        raise RecipeError(f"run folder {where}: rank(s) {blind} do not see what rank 0 writes there; "
                          "every rank writes into the run folder, so on several nodes it must be on a filesystem "
                          "they all share (set output_dir to one, docs/cluster.md)")


def open_run(cfg: RunConfig, resume: str | None = None) -> DistillRun:
    """Check the recipe's setup (before any heavy work), build and load the models, and restore the
    last checkpoint of a resumed run (a run killed before its first checkpoint starts over)."""
    setup, _ = check_setup(cfg)  # fails fast, naming the problem: data, splits, models, teacher specs
    for spec in (s for s in setup.teacher_specs.values() if s.backend == "vllm_server"):
        check_server(spec)  # a server that is not vLLM is refused now, not at the first scoring
    run_dir, resuming = run_dir_for(cfg, resume)
    if rank_and_world()[1] > 1:
        init_process_group()  # for the collectives below (one process joins it later, in the Trainer)
        check_shared_run_dir(run_dir)
    build_missing_models(cfg, setup)
    seed_everything(cfg.seed)  # after the builds, which draw random numbers of their own
    trainer, tokenizer, policy, teachers = load_models(cfg, setup)
    run_pixel_store(cfg, setup.spec, run_dir)
    screens = attach_run_screens(setup.spec, setup.student_path, policy, teachers, reader_for(cfg.student))
    trainer.images = screens  # a student that reads screenshots trains on their pixels
    depth = make_depth(cfg)
    outcomes = Outcomes(cfg)

    start_step, ledger, spent = 0, Ledger(), WorkSpent()
    state = ckpt.restore_checkpoint(run_dir, trainer) if resuming else None
    if state is not None:
        with trainer.gathered_parameters() as student_weights:
            policy.update_weights(student_weights)
        depth.load_state_dict(state["depth"])
        outcomes.load_state_dict(state.get("outcomes", {}))  # older checkpoints: none kept
        start_step, spent = state["step"], WorkSpent(**state.get("spent", {}))  # older checkpoints: none kept
        ledger = Ledger(train_time_offset=state["train_time_s"], wall_time_offset=state["wall_time_s"])
    if resuming and rank_and_world()[0] == 0:
        dropped = truncate_after_step(run_dir / "metrics.jsonl", start_step)
        if start_step:
            print(f"resuming {run_dir} from step {start_step} ({dropped} records past it dropped)")
    log = RunLog(cfg, run_dir, ledger, start_step, setup)
    return DistillRun(cfg, setup, run_dir, start_step, ledger, log, trainer, tokenizer, policy, teachers, depth, spent,
                      outcomes, screens)
