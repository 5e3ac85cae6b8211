"""The DeepSpeed trainer: one optimizer step of the OPD loss per call (or, with
trainer.turn_rows_per_update, one per that many turn rows of the call's batch).

loss = sum_p w_p * l_p over the action tokens p of the GLOBAL batch (all ranks), with l_p from the
objective's estimator and w_p from turnopd.algorithm.objective.final_token_weights: the loss mode's
weight, scaled by each turn's teacher familiarity under `familiarity.mode` weight or gate (the
signals come with the batch, or from the teacher's forward here when it runs in this process, which
then runs before the student's so the weights are known) and by each trajectory's loss weight
(Trajectory.loss_weight, where the batch carries them). A step packs this rank's sequences into micro-batches by token count, runs forward and
backward on each (gradients accumulate; the last backward is the accumulation boundary), then takes
one optimizer step. Every rank runs the same number of micro-batches (padding ones contribute zero
loss), since each backward may join collectives.

With trainer.turn_rows_per_update K the call's turn rows (a turn's action tokens; TCOD trains each
turn as its own row) are cut, in batch order, into consecutive updates of at most K rows (K / ranks
per rank), each normalized over its own tokens on all ranks and followed by its own optimizer step,
as TCOD's trainer takes a fixed 64 rows per step; a sequence holding turns of two updates runs in
both, its other turns at weight 0. Estimators that read the proximal log-probs then get them from a
forward pass before the first update (the weights the call started from).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from turnopd.algorithm.familiarity import familiarity_factors
from turnopd.algorithm.objective import (
    ESTIMATORS,
    TokenInputs,
    WeightParams,
    deep_turn_share,
    final_token_weights,
    per_trajectory_turn_means,
    turn_row_index,
)
from turnopd.algorithm.token_alignment import VocabMap
from turnopd.config import FamiliarityConfig, LossConfig, ObjectiveConfig, TrainerConfig
from turnopd.core.checkpoint import load_plain
from turnopd.core.device import synchronize
from turnopd.core.distributed import gather_objects
from turnopd.core.faults import failpoint
from turnopd.core.types import TokenBatch
from turnopd.loaders.hf_models import resolve_dtype
from turnopd.loaders.lora import is_adapter_model
from turnopd.trainer.deepspeed_setup import deepspeed_config, init_process_group
from turnopd.trainer.packing import MicroBatch, build_micro_batch, pack_by_tokens, padding_micro_batch
from turnopd.trainer.schedule import lr_factor
from turnopd.trainer.scorer import ActionScorer, check_causal_lm, decode, select_predicting, turn_signals

CHECKPOINT_TAG = "state"  # DeepSpeed's sub-folder of `<dir>/deepspeed` holding optimizer and scheduler


def deepspeed_state_classes() -> list[type]:
    """The classes DeepSpeed's optimizer and model state files pickle besides tensors and plain data
    (ZeRO partitions' fragment addresses, the loss scaler, the ZeRO stage)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [fragment_address, LossScaler, ZeroStageEnum]


class TrainingDiverged(RuntimeError):
    """`trainer.max_bad_steps` optimizer steps in a row had a NaN/inf loss or gradient."""


@dataclass(frozen=True)
class ActionTokens:
    """The batch's per-token tensors restricted to action tokens (in `loss_mask.nonzero()` order)."""

    traj_ids: torch.Tensor
    turn_ids: torch.Tensor
    old_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    signals: dict[str, torch.Tensor]  # familiarity signal -> each token's turn value
    trajectory_weights: torch.Tensor | None  # each token's trajectory loss-weight factor (TokenBatch's)
    sequence_ids: torch.Tensor  # the index of the batch sequence each token is in
    proximal_logprobs: torch.Tensor | None = None  # under the weights the step started from (several updates)
    advantages: torch.Tensor | None = None  # each token's trajectory advantage (the reward term's; TokenBatch's)

    @classmethod
    def of(cls, batch: TokenBatch) -> ActionTokens:
        m = batch.loss_mask
        topk = batch.teacher_topk_ids is not None and batch.teacher_topk_logprobs is not None
        sequence_of_position = torch.repeat_interleave(torch.arange(batch.seq_lens.numel()), batch.seq_lens)
        return cls(batch.traj_ids[m], batch.turn_ids[m], batch.old_logprobs[m], batch.teacher_logprobs[m],
                   batch.teacher_topk_ids[m] if topk else None, batch.teacher_topk_logprobs[m] if topk else None,
                   {name: values[m].double() for name, values in batch.turn_signals.items()},
                   None if batch.trajectory_weights is None else batch.trajectory_weights[batch.traj_ids[m]],
                   sequence_of_position[m],
                   advantages=None if batch.advantages is None else batch.advantages[batch.traj_ids[m]])

    @property
    def count(self) -> int:
        return int(self.traj_ids.numel())

    def select(self, index: torch.Tensor) -> ActionTokens:
        """The tokens at `index` (one update's), every per-token tensor indexed alike."""
        def pick(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[index]

        return ActionTokens(self.traj_ids[index], self.turn_ids[index], self.old_logprobs[index],
                            self.teacher_logprobs[index], pick(self.topk_ids), pick(self.topk_logprobs),
                            {name: values[index] for name, values in self.signals.items()},
                            pick(self.trajectory_weights), self.sequence_ids[index], pick(self.proximal_logprobs),
                            pick(self.advantages))


@dataclass(frozen=True)
class UpdatePlan:
    """One optimizer update of a step: the action tokens it trains (indices into the step's
    ActionTokens) and the micro-batches of the sequences that hold them."""

    index: torch.Tensor
    micro_batches: list[MicroBatch]


@dataclass(frozen=True)
class StepResult:
    """What one `Trainer.step` measured over the global batch (every rank holds the same)."""

    loss: float  # the mean over the step's updates of each one's loss
    mean_kl: float  # over the action tokens
    deep_turn_share: float  # the weighted loss's share on the deepest third of turns (objective.deep_turn_share)
    turn_kl: list[list[float]]  # per trajectory of the batch (rank-major, as gather_objects orders them), per turn
    turn_signals: dict[str, list[list[float]]]  # per familiarity signal the teacher scored, the same layout
    tokens_trained: int  # prompt + action tokens run through the student (no padding)
    action_tokens: int
    padding_share: float
    grad_norm: float | None  # before clipping, the mean over the updates (None: nothing trained)
    lr: float
    num_micro_batches: int
    optimizer_updates: int
    skipped: bool  # an update was not applied (a non-finite loss or gradient), or the batch was dropped
    train_parts: dict[str, float]  # seconds: teacher, forward_backward, optimizer
    familiarity_kept_share: float | None  # the weight the familiar turns kept (familiarity.mode weight or gate)
    dropped: bool = False  # the batch was not trained on: an image of it was lost (see Trainer.images)
    missing_images: int = 0


@dataclass(frozen=True)
class UpdateResult:
    applied: bool
    grad_norm: float
    familiarity_kept_share: float | None
    num_micro_batches: int
    seconds: dict[str, float]  # teacher, forward_backward, optimizer (the device synchronized at each end)


class PartClock:
    """Seconds per part of an update, each lap ending when the device has finished its kernels."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.seconds[part] = now - self._last
        self._last = now


@dataclass
class StepTally:
    """What one step accumulates over its micro-batches (per-token values in action-token order)."""

    token_loss: torch.Tensor
    token_kl: torch.Tensor
    loss: float = 0.0
    tokens: int = 0  # real tokens run through the student
    padding: int = 0

    @classmethod
    def for_tokens(cls, count: int) -> StepTally:
        return cls(torch.zeros(count, dtype=torch.float64), torch.zeros(count, dtype=torch.float64))


def decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear and embedding weights), none on norms and biases. An empty group
    is left out (a LoRA adapter has matrices only): ZeRO drops it, and the schedule would not line up."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def keep_trainable(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any, *,
                   trainable: set[str]) -> None:
    """A state_dict post-hook: drop every tensor but the trainable parameters'."""
    for key in [k for k in state if k.removeprefix(prefix) not in trainable]:
        del state[key]


def check_in_process_teacher(student: nn.Module, teacher: nn.Module | None, estimator: str,
                             vocab: int | None = None) -> int:
    """An estimator that reads the teacher's hidden states needs the teacher here, a causal LM whose
    output head covers the tokenizer's vocabulary. Returns V, the head rows compared: all of them when
    both heads have as many, else the shared tokenizer's `vocab` (len(tokenizer)), the rows past it
    being the padding of an embedding table rounded up (Qwen2.5 0.5B-3B: 151,936 rows, 7B+: 152,064,
    one tokenizer of 151,665 ids), which no text tokenizes to."""
    if teacher is None:
        raise ValueError(f"objective.estimator={estimator} needs the teacher model in this "
                         "process (teacher_model=...); use k1, k3 or topk with a remote teacher")
    check_causal_lm(teacher, "teacher")
    rows = (student.get_output_embeddings().weight.shape[0], teacher.get_output_embeddings().weight.shape[0])
    if rows[0] == rows[1]:
        return rows[0]
    if vocab is None or vocab > min(rows):
        raise ValueError(f"estimator=full: the student's output head has {rows[0]} rows and the teacher's {rows[1]}; "
                         f"they are compared on their shared tokenizer's vocabulary, which must fit both "
                         f"(got {vocab})")
    return vocab


class Trainer:
    """A DeepSpeed engine around an HF causal LM student, minimizing the OPD loss.

    Trainer(model, trainer_cfg, objective_cfg, loss_cfg, total_steps, teacher_model=None, familiarity_cfg=None,
            vocab=None, vocab_map=None) vocab: the tokenizer's vocabulary size (`full` with heads of unequal rows);
                                        vocab_map: the (student, teacher) tokenizers' (topk_cross)
    step(batch, alpha) -> StepResult   one optimizer step on this rank's share of the batch
    module                              the HF model (trained in place)
    save(dir) / load(dir)               HF weights + optimizer + scheduler + step counter; call on
                                        every rank with the same dir (ZeRO partitions are per rank)
    """

    def __init__(self, model: nn.Module, trainer_cfg: TrainerConfig, objective_cfg: ObjectiveConfig,
                 loss_cfg: LossConfig, total_steps: int, teacher_model: nn.Module | dict[str, nn.Module] | None = None,
                 familiarity_cfg: FamiliarityConfig | None = None, vocab: int | None = None,
                 vocab_map: VocabMap | None = None):
        init_process_group()  # before importing deepspeed: it picks the accelerator on import

        self.cfg, self.objective, self.loss_cfg = trainer_cfg, objective_cfg, loss_cfg
        self.familiarity = familiarity_cfg or FamiliarityConfig()
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        check_causal_lm(model, "student")
        self.estimator = ESTIMATORS.get(objective_cfg.estimator)
        # a multi-env run's in-process teachers come by env name, each reading its env's sequences
        teachers = teacher_model if isinstance(teacher_model, dict) else {None: teacher_model}
        # V, the head rows compared: one for every teacher, as they all score the student's tokenizer
        self.vocab = min(check_in_process_teacher(model, teacher, objective_cfg.estimator, vocab)
                         for teacher in teachers.values()) if self.estimator.needs_teacher_model else None
        if self.estimator.needs_vocab_map and vocab_map is None:
            raise ValueError(f"objective.estimator={self.estimator.name} reads a teacher's top-k in its own vocabulary: "
                             "give the trainer the (student, teacher) vocabulary map (token_alignment.vocab_map)")
        self.vocab_map = vocab_map if self.estimator.needs_vocab_map else None
        # the student ids no teacher id is paired with, over its head's rows (read before ZeRO-3 partitions it)
        self.rest_mask = vocab_map.rest_mask(model.get_output_embeddings().weight.shape[0]) if self.vocab_map else None
        dtype = resolve_dtype(trainer_cfg.dtype)
        if trainer_cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.engine, self._bare_optimizer = self._initialize(model, total_steps, dtype)
        self.device = self.engine.device
        self.teachers: dict[str | None, nn.Module] = {}
        if self.estimator.needs_teacher_model:
            self.teachers = {env: teacher.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
                             for env, teacher in teachers.items()}
        self.rank, self.world_size = self.engine.global_rank, self.engine.dp_world_size
        rows = trainer_cfg.turn_rows_per_update
        if rows is not None and rows % self.world_size:  # the launch's, not the recipe's: checked here
            raise ValueError(f"trainer.turn_rows_per_update={rows} does not split over {self.world_size} data-parallel "
                             "ranks: each rank trains an equal share of every update's rows")
        self.steps_taken = 0  # step() calls completed (applied or skipped)
        self.bad_streak = 0  # skipped steps in a row
        # a vision-language student: its batches' image keys -> pixel_values (`missing(keys)`, `(keys)`),
        # fetched as each micro-batch runs (turnopd.loaders.screens.ScreenPixels; set by the run's start-up)
        self.images: Any = None

    def _initialize(self, model: nn.Module, total_steps: int, dtype: torch.dtype) -> tuple[Any, bool]:
        """The DeepSpeed engine around the student's scorer, with a fused AdamW and the lr schedule, and
        whether DeepSpeed steps the bare torch optimizer (ZeRO-0 in fp32: no overflow check of its own)."""
        import deepspeed

        cfg = self.cfg
        scorer = ActionScorer(model, self.objective.chunk_size, cfg.shared_prefix)
        self.adapter_only = is_adapter_model(model)
        if self.adapter_only:  # DeepSpeed's checkpoint holds the adapter alone: the frozen base (tied head
            # included, which exclude_frozen_parameters would keep) comes from the base model
            scorer.register_state_dict_post_hook(functools.partial(keep_trainable, trainable={
                name for name, p in scorer.named_parameters() if p.requires_grad}))
        # fused: one vectorized kernel (on CPU ~6x faster than the per-tensor loop), no extension build
        optimizer = torch.optim.AdamW(decay_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                                      fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
            lr_factor, total_steps=total_steps, warmup_steps=cfg.lr_warmup_steps, schedule=cfg.lr_schedule))
        engine, *_ = deepspeed.initialize(model=scorer, optimizer=optimizer, lr_scheduler=schedule,
                                          config=deepspeed_config(cfg, dtype))
        if cfg.zero_stage == 3:
            # ZeRO-3 gathers a parameter only for its owner's forward; the head is read in the scorer's.
            deepspeed.zero.register_external_parameter(engine.module, scorer.head_weight)
        if cfg.zero_stage == 0 and engine.dp_world_size == 1:
            # ZeRO-0 would flatten, "all-reduce" over one rank and copy back every gradient per step
            engine.enable_backward_allreduce = False
        return engine, engine.optimizer is optimizer

    @property
    def module(self) -> nn.Module:
        """The student HF model (its parameters are the trained ones; under ZeRO-3 read them inside
        `gathered_parameters()`)."""
        return self.engine.module.model

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[nn.Module]:
        """The student with full parameters inside the block (ZeRO-3 partitions them between steps;
        a no-op otherwise). Enter on every rank."""
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None,
                                               enabled=self.cfg.zero_stage == 3):
            yield self.module

    # ---------------------------------------------------------------------------------------
    # One optimizer step
    # ---------------------------------------------------------------------------------------

    def step(self, batch: TokenBatch, alpha: float) -> StepResult:
        """One optimizer step on this rank's share of the batch (trajectory indices local to it), or
        with trainer.turn_rows_per_update one per that many turn rows (see the module docstring)."""
        self._check_batch(batch)
        tokens = ActionTokens.of(batch)
        if self.images is not None:  # a student that reads images (every rank): are they all there?
            keys = [key for sequence_keys in batch.image_keys for key in sequence_keys]
            (missing,) = self._sum_over_ranks([len(self.images.missing(keys))])
            if missing:  # an image lost from its store: the batch is dropped, not trained on blind
                return self._dropped(batch.num_trajectories, int(missing))
        (num_action,) = self._sum_over_ranks([tokens.count])
        if num_action == 0:
            raise ValueError("the batch has no action tokens to train on (on any rank)")
        plans = self._plan_updates(batch, tokens)
        (num_updates,) = self._all_reduce([len(plans)], "max")  # a rank with fewer rows pads with empty updates
        if self.estimator.needs_proximal_logprobs and num_updates > 1:
            tokens = dataclasses.replace(tokens, proximal_logprobs=self._proximal_logprobs(batch, tokens))
        weighted = self._any_rank(tokens.trajectory_weights is not None)  # the batch carries trajectory weights
        weights = torch.zeros(tokens.count)
        tally = StepTally.for_tokens(tokens.count)
        lr = float(self.engine.get_lr()[0])
        empty = UpdatePlan(torch.zeros(0, dtype=torch.long), [])
        updates = [self._update(plans[u] if u < len(plans) else empty, tokens, alpha, weights, tally, weighted)
                   for u in range(int(num_updates))]
        applied = all(u.applied for u in updates)
        self.steps_taken += 1
        self.bad_streak = 0 if applied else self.bad_streak + 1
        kept = [u.familiarity_kept_share for u in updates if u.familiarity_kept_share is not None]
        result = self._result(tokens, weights, tally, int(num_action), batch.num_trajectories, updates, lr,
                              sum(kept) / len(kept) if kept else None)
        if self.bad_streak >= self.cfg.max_bad_steps:
            raise TrainingDiverged(
                f"{self.bad_streak} optimizer steps in a row had a NaN/inf loss or gradient and were skipped "
                f"(trainer.max_bad_steps={self.cfg.max_bad_steps}); last step: loss={result.loss}, "
                f"grad_norm={result.grad_norm}. Lower trainer.lr, check the teacher log-probs, or set "
                "objective.clip_eps")
        return result

    def _dropped(self, num_trajectories: int, missing: int) -> StepResult:
        """The result of a step whose batch was dropped (every rank agrees): no forward, no update; its
        loss and KL were not measured (NaN), its trajectories have no per-turn KL."""
        self.steps_taken += 1
        nothing = [[] for _ in range(num_trajectories)]
        return StepResult(loss=float("nan"), mean_kl=float("nan"), deep_turn_share=0.0,
                          turn_kl=[kls for part in gather_objects(nothing) for kls in part], turn_signals={},
                          tokens_trained=0, action_tokens=0, padding_share=0.0, grad_norm=None,
                          lr=float(self.engine.get_lr()[0]), num_micro_batches=0, optimizer_updates=0, skipped=True,
                          train_parts={}, familiarity_kept_share=None, dropped=True, missing_images=missing)

    def _update(self, plan: UpdatePlan, tokens: ActionTokens, alpha: float, weights: torch.Tensor,
                tally: StepTally, weighted: bool) -> UpdateResult:
        """One optimizer update on the plan's tokens: their weights (final_token_weights, normalized over
        the update's tokens on all ranks; written into `weights` at the plan's indices), forward and
        backward per micro-batch (the other tokens of its sequences at weight 0), the optimizer step."""
        part = tokens.select(plan.index)
        # N_traj counts the trajectories with action tokens, as token_weights does in one process
        counts = self._global_counts(int(part.traj_ids.unique().numel()), part.count,
                                     int(turn_row_index(part.traj_ids, part.turn_ids).unique().numel()))
        num_micro = int(self._all_reduce([len(plan.micro_batches)], "max")[0])
        clock = PartClock(self.device)
        teacher_hidden = [self._teacher_pass(mb, tokens) for mb in plan.micro_batches] if self.teachers else []
        clock.lap("teacher")
        part = tokens.select(plan.index)  # with the familiarity signals the teacher's forward just wrote
        own, kept_share = final_token_weights(
            part.traj_ids, part.turn_ids, self.loss_cfg.mode, WeightParams(alpha, self.loss_cfg.constant_k), counts,
            familiarity=self._familiarity_factors(part), sum_over_ranks=self._sum_over_ranks,
            trajectory=self._trajectory_factors(part) if weighted else None)
        update_weights = torch.zeros(tokens.count)
        update_weights[plan.index] = own.to(update_weights)
        weights[plan.index] = own.to(weights)
        in_update = torch.zeros(tokens.count, dtype=torch.bool)
        in_update[plan.index] = True
        self._forward_backward(plan, tokens, teacher_hidden, update_weights, in_update, num_micro, tally)
        clock.lap("forward_backward")
        failpoint("trainer.optimizer_step")
        applied, grad_norm = self._optimizer_step()
        clock.lap("optimizer")
        return UpdateResult(applied, grad_norm, kept_share, num_micro, clock.seconds)

    def _forward_backward(self, plan: UpdatePlan, tokens: ActionTokens, teacher_hidden: list[torch.Tensor],
                          update_weights: torch.Tensor, in_update: torch.Tensor, num_micro: int, tally: StepTally
                          ) -> None:
        """Forward and backward of each of the update's micro-batches (padding ones past this rank's), the
        gradients accumulating to the last; the per-token losses and KL of the update's tokens into `tally`."""
        nonfinite = False
        for i in range(num_micro):
            last = i == num_micro - 1
            mb = plan.micro_batches[i] if i < len(plan.micro_batches) else padding_micro_batch()
            self.engine.set_gradient_accumulation_boundary(last)
            if mb.num_tokens == 0:  # padding micro-batch: a zero loss through every trained parameter
                loss = self._padding_loss(mb)
            else:
                per_token, kl = self._token_losses(mb, tokens, teacher_hidden[i] if teacher_hidden else None)
                loss = (update_weights[mb.action_index].to(per_token) * per_token).sum()
                mine = in_update[mb.action_index]
                tally.token_loss[mb.action_index[mine]] = per_token.detach().double().cpu()[mine]
                tally.token_kl[mb.action_index[mine]] = kl.detach().double().cpu()[mine]
            nonfinite = nonfinite or not bool(torch.isfinite(loss))
            if last and self._any_rank(nonfinite):
                # A non-finite loss anywhere makes the last backward poison the gradients, so the
                # overflow check at the optimizer step discards the whole update on every rank.
                loss = loss * float("nan")
            # DeepSpeed averages gradients over ranks; the global loss is their sum.
            self.engine.backward(loss * self.world_size)
            tally.loss += float(loss.detach())
            tally.padding += mb.num_padding
            tally.tokens += mb.num_tokens

    def _plan_updates(self, batch: TokenBatch, tokens: ActionTokens) -> list[UpdatePlan]:
        """The step's updates: one on every action token of this rank, or with turn_rows_per_update K
        one per K / ranks consecutive turn rows of this rank in batch order (trajectory by trajectory,
        turn by turn; the last may hold fewer)."""
        rows = self.cfg.turn_rows_per_update
        if rows is None:
            chunks = [torch.arange(tokens.count)]
        else:
            chunk_of_token = turn_row_index(tokens.traj_ids, tokens.turn_ids) // (rows // self.world_size)
            chunks = [(chunk_of_token == c).nonzero().squeeze(1) for c in torch.unique(chunk_of_token).tolist()]
        return [UpdatePlan(index, self._pack(batch, tokens.sequence_ids[index].unique().tolist())) for index in chunks]

    @torch.no_grad()
    def _proximal_logprobs(self, batch: TokenBatch, tokens: ActionTokens) -> torch.Tensor:
        """The student's log-prob of every action token under the weights the step starts from, from a
        forward without grad before its first update (AReaL's recomputed prox_logp, verl's recomputed
        old_log_prob): what k1_decoupled reads as pi_prox when a step takes several updates."""
        micro_batches = self._pack(batch, tokens.sequence_ids.unique().tolist())
        (most,) = self._all_reduce([len(micro_batches)], "max")  # ZeRO-3 forwards join collectives
        out = torch.zeros(tokens.count)
        for i in range(int(most)):
            mb = micro_batches[i] if i < len(micro_batches) else padding_micro_batch()
            unused = torch.zeros(int(mb.scored.sum()), device=self.device)
            nll = self.engine(mb.input_ids.to(self.device), mb.scored.to(self.device), ESTIMATORS.get("nll"),
                              self.objective, TokenInputs(sampling=unused, teacher=unused),
                              pixel_values=self._pixel_values(mb))["loss"]
            if mb.num_tokens:
                out[mb.action_index] = -nll.float().cpu()
        return out

    def _check_batch(self, batch: TokenBatch) -> None:
        if self.estimator.needs_teacher_topk and batch.teacher_topk_ids is None:
            raise ValueError(f"objective.estimator={self.estimator.name} needs the teacher's top-k ids and log-probs "
                             "in the batch (score the trajectories with top-k: turnopd.orchestration scores with "
                             "objective.topk for this estimator)")
        if self.objective.reward_weight > 0 and batch.advantages is None:
            raise ValueError(f"objective.reward_weight={self.objective.reward_weight} needs each trajectory's "
                             "advantage in the batch (Trajectory.advantage; turnopd.orchestration.outcomes sets it)")
        starts = torch.cumsum(batch.seq_lens, 0) - batch.seq_lens
        if batch.num_tokens and bool(batch.loss_mask[starts[batch.seq_lens > 0]].any()):
            raise ValueError("a sequence starts with an action token: its log-prob has no context to be "
                             "predicted from (every sequence must begin with prompt tokens)")

    def _pack(self, batch: TokenBatch, trained: list[int]) -> list[MicroBatch]:
        """Micro-batches of the sequences `trained` (those that hold the update's action tokens; the
        others need no forward). With in-process teachers by env, each micro-batch holds one env's
        sequences: one teacher's forward and output head serve all its rows."""
        by_teacher: dict[str | None, list[int]] = {}
        for i in trained:
            by_teacher.setdefault(self._teacher_of_sequence(batch, i), []).append(i)
        return [dataclasses.replace(build_micro_batch(batch, [part[j] for j in group]), teacher=teacher)
                for teacher, part in by_teacher.items()
                for group in pack_by_tokens([int(batch.seq_lens[i]) for i in part], self.cfg.micro_batch_tokens)]

    def _teacher_of_sequence(self, batch: TokenBatch, sequence: int) -> str | None:
        """The env whose in-process teacher reads sequence `sequence` (None: one teacher, or none)."""
        if None in self.teachers or not self.teachers:
            return None
        return batch.trajectory_envs[int(batch.traj_ids[int(batch.seq_lens[:sequence].sum())])]

    @torch.no_grad()
    def _teacher_pass(self, mb: MicroBatch, tokens: ActionTokens) -> torch.Tensor:
        """The in-process teacher's forward on a micro-batch: its hidden states at the positions that
        predict action tokens (the full estimator's input), and (familiarity.signals) the turns'
        familiarity signals written into `tokens.signals` (the same forward: no second pass)."""
        ids, scored = mb.input_ids.to(self.device), mb.scored.to(self.device)
        teacher = self.teachers[mb.teacher]
        hidden = decode(teacher, ids, self.cfg.shared_prefix)
        if not self.familiarity.signals:
            return select_predicting(hidden, ids, scored)[0]
        for name, values in turn_signals(hidden, teacher.get_output_embeddings().weight, ids, scored,
                                         self.objective.chunk_size).items():
            tokens.signals.setdefault(name, torch.full((tokens.count,), float("nan"), dtype=torch.float64))[
                mb.action_index] = values
        return select_predicting(hidden, ids, scored)[0]

    @staticmethod
    def _trajectory_factors(tokens: ActionTokens) -> torch.Tensor:
        """Each token's trajectory loss-weight factor f (1 on a rank whose trajectories carry none)."""
        if tokens.trajectory_weights is None:
            return torch.ones(tokens.count, dtype=torch.float64)
        return tokens.trajectory_weights

    def _familiarity_factors(self, tokens: ActionTokens) -> torch.Tensor | None:
        """Each token's familiarity factor g under familiarity.mode weight or gate (None with mode none)."""
        fam = self.familiarity
        if fam.mode == "none":
            return None
        if not tokens.count:
            return torch.zeros(0)
        values = tokens.signals.get(fam.signal)
        if values is None:
            raise ValueError(f"familiarity.signal={fam.signal} is not in the batch: the teacher scored no "
                             f"{fam.signal} (action_entropy from a vllm teacher needs familiarity.topk)")
        return familiarity_factors(values, fam.mode, fam.signal, fam.threshold, fam.temperature)

    def _token_losses(self, mb: MicroBatch, tokens: ActionTokens, teacher_hidden: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token loss l_p (with grad) and per-token KL (for the metrics) of the micro-batch's action
        tokens, in `mb.action_index` order: the estimator's inputs from the batch (and the teacher's
        hidden states, from `_teacher_pass`, when it runs here), the student's side from the engine's
        forward."""
        idx, device = mb.action_index, self.device
        ids, scored = mb.input_ids.to(device), mb.scored.to(device)
        inputs = TokenInputs(sampling=tokens.old_logprobs[idx].to(device), teacher=tokens.teacher_logprobs[idx].to(device))
        if tokens.proximal_logprobs is not None:  # else the forward's own, detached (scorer.ActionScorer)
            inputs = dataclasses.replace(inputs, proximal=tokens.proximal_logprobs[idx].to(device))
        if self.objective.reward_weight > 0:  # the reward term (none computed at 0: pure OPD as it was)
            inputs = dataclasses.replace(inputs, advantage=tokens.advantages[idx].to(device))
        if self.estimator.needs_teacher_topk:
            topk_ids = tokens.topk_ids[idx]
            if self.vocab_map is not None:  # a teacher of another tokenizer: its ids as the student's (-1: none)
                topk_ids = self.vocab_map.student_ids(topk_ids)
                inputs = dataclasses.replace(inputs, student_rest_mask=self.rest_mask.to(device))
            inputs = dataclasses.replace(inputs, teacher_topk_ids=topk_ids.to(device),
                                         teacher_topk=tokens.topk_logprobs[idx].to(device))
        if self.estimator.needs_teacher_model:
            inputs = dataclasses.replace(inputs, teacher_hidden=teacher_hidden,
                                         teacher_head=self.teachers[mb.teacher].get_output_embeddings().weight[: self.vocab])
        out = self.engine(ids, scored, self.estimator, self.objective, inputs, pixel_values=self._pixel_values(mb))
        return out["loss"], out["kl"]

    def _pixel_values(self, mb: MicroBatch) -> torch.Tensor | None:
        """The micro-batch's images as the student's pixel_values, fetched now (None: no images)."""
        if not mb.image_keys:
            return None
        return self.images(list(mb.image_keys)).to(self.device, next(self.module.parameters()).dtype)

    def _padding_loss(self, mb: MicroBatch) -> torch.Tensor:
        """Zero times the student's log-prob of the padding token: a backward through every trained
        parameter (the collectives of ZeRO need every rank to join), whatever the estimator."""
        zero = torch.zeros(1, device=self.device)
        out = self.engine(mb.input_ids.to(self.device), mb.scored.to(self.device), ESTIMATORS.get("nll"),
                          self.objective, TokenInputs(sampling=zero, teacher=zero))
        return out["loss"].sum() * 0.0

    def _optimizer_step(self) -> tuple[bool, float]:
        """Take the optimizer step unless the gradient is not finite. Returns (applied, grad norm
        before clipping)."""
        if self._bare_optimizer:
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads))
            if not math.isfinite(norm):
                self.engine.zero_grad()  # gradients live in p.grad only: dropping them skips the step
                return False, norm
            self.engine.step()
            return True, norm
        self.engine.step()  # ZeRO and bf16 optimizers skip a step whose gradient norm is not finite
        norm = self.engine.get_global_grad_norm()
        return self.engine.was_step_applied(), float("nan") if norm is None else float(norm)

    def _result(self, tokens: ActionTokens, weights: torch.Tensor, tally: StepTally, num_action: int,
                num_trajectories: int, updates: list[UpdateResult], lr: float, kept: float | None) -> StepResult:
        """Loss (the mean over the step's updates of each one's), KL and shares over the global batch
        (summed over ranks)."""
        loss, kl_sum, pad_tokens, real_tokens = self._sum_over_ranks(
            [tally.loss, float(tally.token_kl.sum()), float(tally.padding), float(tally.tokens)])
        local_turn_kl = per_trajectory_turn_means(tally.token_kl, tokens.traj_ids, tokens.turn_ids, num_trajectories)
        local_signals = {name: per_trajectory_turn_means(values, tokens.traj_ids, tokens.turn_ids, num_trajectories)
                         for name, values in sorted(tokens.signals.items())}
        return StepResult(
            loss=loss / len(updates), mean_kl=kl_sum / num_action,
            deep_turn_share=deep_turn_share(weights, tally.token_loss, tokens.turn_ids, tokens.traj_ids,
                                            self._sum_over_ranks),
            turn_kl=[kls for part in gather_objects(local_turn_kl) for kls in part],
            turn_signals={name: [turns for part in gather_objects(per_traj) for turns in part]
                          for name, per_traj in local_signals.items()},
            tokens_trained=int(real_tokens), action_tokens=num_action,
            padding_share=pad_tokens / (pad_tokens + real_tokens),
            grad_norm=sum(u.grad_norm for u in updates) / len(updates), lr=lr,
            num_micro_batches=sum(u.num_micro_batches for u in updates), optimizer_updates=len(updates),
            skipped=not all(u.applied for u in updates),
            train_parts={part: sum(u.seconds[part] for u in updates) for part in updates[0].seconds},
            familiarity_kept_share=kept)

    # ---------------------------------------------------------------------------------------
    # Collectives over the data-parallel ranks
    # ---------------------------------------------------------------------------------------

    def _all_reduce(self, values: list[float], op: str) -> list[float]:
        import deepspeed.comm as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, "sum")

    def _any_rank(self, flag: bool) -> bool:
        return self._all_reduce([float(flag)], "max")[0] > 0

    def _global_counts(self, num_traj: int, num_action: int, num_rows: int) -> tuple[int, int, int]:
        """(N_traj, N_tokens, N_rows) summed over ranks."""
        total_traj, total_action, total_rows = self._sum_over_ranks([num_traj, num_action, num_rows])
        return int(total_traj), int(total_action), int(total_rows)

    # ---------------------------------------------------------------------------------------
    # Checkpoints
    # ---------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """The student in Hugging Face format (`from_pretrained(directory)` loads it; a LoRA student's
        adapter, which `PeftModel.from_pretrained(base, directory)` loads) plus, under
        `directory/deepspeed`, the optimizer, scheduler and step counters (per-rank ZeRO partitions)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with self.gathered_parameters() as model:
            if self.rank == 0:
                model.save_pretrained(directory)
        self.engine.save_checkpoint(str(directory / "deepspeed"), tag=CHECKPOINT_TAG, save_latest=False,
                                    client_state={"steps_taken": self.steps_taken, "bad_streak": self.bad_streak})

    def load(self, directory: str | Path) -> None:
        """Restore what `save` wrote: weights, optimizer, scheduler and step counters."""
        state_dir = Path(directory) / "deepspeed"
        if not (state_dir / CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"no trainer state in {directory} (expected {state_dir / CHECKPOINT_TAG})")
        # DeepSpeed's own loader unpickles with weights_only=False: a crafted file would run code.
        # Its state files hold tensors, plain data and the few DeepSpeed classes named here.
        self.engine.checkpoint_engine.load = functools.partial(load_plain, allowed=deepspeed_state_classes())
        path, client = self.engine.load_checkpoint(str(state_dir), tag=CHECKPOINT_TAG, load_module_strict=not self.adapter_only,
                                                   load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the trainer state from {state_dir}")
        self.steps_taken, self.bad_streak = client["steps_taken"], client["bad_streak"]
