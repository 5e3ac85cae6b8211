"""The DeepSpeed trainer in one plain process, against losses and AdamW steps computed independently
from a full forward of a copy of the model (tests/trainer/helpers.py)."""

import copy
import dataclasses
import math
import time

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.trainer.helpers import (
    VOCAB,
    configs,
    random_trajectories,
    reference_loss,
    reference_token_logprobs,
    reference_weights,
    tiny_llama,
)
from turnopd.algorithm.objective import token_weights
from turnopd.core.types import Trajectory, Turn, build_token_batch
from turnopd.trainer import Trainer, TrainingDiverged

TRAJS = random_trajectories(seed=0, count=6, topk=True)


def params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_adam_params_match(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal to 1e-6 but for a few elements. Adam's early updates lr * m / sqrt(v) are about
    lr * sign(g) for every element, so the few elements whose gradient is ~1e-7 (under 0.5%) move by
    an amount that float summation order changes; they are held to 5e-4, while a wrong gradient
    would move most elements by ~lr = 1e-2 the wrong way."""
    diffs = torch.cat([(got[k] - expected[k]).abs().flatten() for k in expected])
    assert float(diffs.max()) < 5e-4
    assert float((diffs > 1e-6).double().mean()) < 5e-3


@pytest.mark.parametrize(("estimator", "mode", "tied"), [
    ("k1", "progressive", True), ("k3", "token_mean", True), ("nll", "progressive", True),
    ("topk", "progressive", False), ("full", "token_mean", True)])
def test_loss_equals_weighted_sum_from_a_full_forward(estimator, mode, tied):
    teacher = tiny_llama(seed=1, tied=tied) if estimator == "full" else None
    trainer = Trainer(tiny_llama(seed=0, tied=tied), *configs(estimator, mode, micro_batch_tokens=40), total_steps=4,
                      teacher_model=copy.deepcopy(teacher))
    expected = reference_loss(tiny_llama(seed=0, tied=tied), TRAJS, estimator, mode, alpha=0.3, teacher=teacher)
    metrics = trainer.step(build_token_batch(TRAJS), alpha=0.3)
    assert metrics.num_micro_batches > 1
    assert metrics.loss == pytest.approx(expected.item(), rel=1e-5)
    assert not metrics.skipped


def test_the_reward_term_adds_its_weighted_policy_gradient_and_weight_0_changes_nothing():
    mode = "progressive"
    advantages = [1.5, -0.5, 0.0, 2.0, -1.0, -2.0]
    trajs = [dataclasses.replace(t, advantage=a) for t, a in zip(TRAJS, advantages, strict=True)]
    trainer_cfg, objective, loss_cfg = configs("k1", mode, micro_batch_tokens=40)
    # l_p + 0.5 g_p, g_p = -exp(s - s_old) A_i (its value; its gradient -A grad s at ratio 1)
    rewarded = Trainer(tiny_llama(0), trainer_cfg, dataclasses.replace(objective, reward_weight=0.5), loss_cfg,
                       total_steps=2)
    model = tiny_llama(0)
    rows = reference_token_logprobs(model, trajs)
    tokens = [(turn, j, a) for traj, a in zip(trajs, advantages, strict=True) for turn in traj.turns
              for j in range(len(turn.action_ids))]
    weights = reference_weights(trajs, mode, 0.3)
    pg = sum(w * -math.exp(float(rows[p][turn.action_ids[j]].detach()) - turn.student_logprobs[j]) * a
             for p, ((turn, j, a), w) in enumerate(zip(tokens, weights, strict=True)))
    expected = reference_loss(model, trajs, "k1", mode, alpha=0.3).item() + 0.5 * pg
    assert rewarded.step(build_token_batch(trajs), alpha=0.3).loss == pytest.approx(expected, rel=1e-5)
    # reward_weight 0: the batch's advantages are never read, the step is the pure-OPD one bit for bit
    runs = []
    for batch in (build_token_batch(TRAJS), build_token_batch(trajs)):
        trainer = Trainer(tiny_llama(0), trainer_cfg, objective, loss_cfg, total_steps=2)
        runs.append((trainer.step(batch, alpha=0.3), params(trainer.module)))
    assert runs[0][0].loss == runs[1][0].loss and runs[0][0].grad_norm == runs[1][0].grad_norm
    assert max_diff(runs[0][1], runs[1][1]) == 0.0
    with pytest.raises(ValueError, match="needs each trajectory's advantage"):
        rewarded.step(build_token_batch(TRAJS), alpha=0.3)


def plain_adamw_steps(model, alphas, lr, grad_clip, weight_decay, lr_factors):
    """The same optimization written with plain torch: full-forward loss, clip, AdamW."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": weight_decay},
                             {"params": vectors, "weight_decay": 0.0}], lr=lr)
    norms = []
    for alpha, factor in zip(alphas, lr_factors, strict=True):
        for group in opt.param_groups:
            group["lr"] = lr * factor
        opt.zero_grad()
        reference_loss(model, TRAJS, "k1", "progressive", alpha).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        opt.step()
    return params(model), norms


@pytest.mark.parametrize(("zero_stage", "tied"), [(0, True), (1, True), (2, False), (3, True), (3, False)])
def test_steps_change_parameters_as_plain_adamw(zero_stage, tied):
    trainer = Trainer(tiny_llama(0, tied), *configs("k1", "progressive", zero_stage=zero_stage, micro_batch_tokens=40,
                                                    lr_warmup_steps=2), total_steps=5)
    metrics = [trainer.step(build_token_batch(TRAJS), alpha) for alpha in (0.0, 0.5)]
    # warm-up over 2 steps: lr factors 1/2 then 2/2
    assert [m.lr for m in metrics] == pytest.approx([0.5e-2, 1e-2])
    expected, norms = plain_adamw_steps(tiny_llama(0, tied), (0.0, 0.5), lr=1e-2, grad_clip=1.0,
                                        weight_decay=0.01, lr_factors=(0.5, 1.0))
    # Adam and clipping hide the gradient's scale from the parameters; its norm shows it
    assert [m.grad_norm for m in metrics] == pytest.approx(norms, rel=1e-5)
    with trainer.gathered_parameters() as model:
        got = params(model)
    assert_adam_params_match(got, expected)
    assert max_diff(got, params(tiny_llama(0, tied))) > 1e-3  # and the step did move them


def test_micro_batch_packing_gives_the_parameters_of_one_micro_batch():
    results = []
    for budget in (10_000, 24):
        trainer = Trainer(tiny_llama(0), *configs("k3", "progressive", micro_batch_tokens=budget), total_steps=2)
        metrics = trainer.step(build_token_batch(TRAJS), alpha=0.5)
        results.append((metrics, params(trainer.module)))
    (one, p_one), (many, p_many) = results
    assert one.num_micro_batches == 1 and many.num_micro_batches > 5
    assert many.loss == pytest.approx(one.loss, rel=1e-6)
    assert many.grad_norm == pytest.approx(one.grad_norm, rel=1e-6)
    assert_adam_params_match(p_many, p_one)


def test_activation_checkpointing_leaves_the_step_unchanged():
    out = []
    for checkpointing, zero_stage in ((False, 0), (True, 0), (True, 3)):
        trainer = Trainer(tiny_llama(0), *configs("k1", activation_checkpointing=checkpointing, zero_stage=zero_stage,
                                                  micro_batch_tokens=40), total_steps=2)
        trainer.step(build_token_batch(TRAJS), alpha=0.5)
        with trainer.gathered_parameters() as model:
            out.append(params(model))
    assert_adam_params_match(out[1], out[0])
    assert_adam_params_match(out[2], out[0])


def test_metrics_from_an_independent_computation():
    trainer = Trainer(tiny_llama(0), *configs("k1", "progressive", micro_batch_tokens=10_000), total_steps=2)
    batch = build_token_batch(TRAJS)
    start = time.perf_counter()
    metrics = trainer.step(batch, alpha=0.5)
    took = time.perf_counter() - start
    # the step's parts (no in-process teacher here: its part is ~0) fit inside its wall-clock
    assert set(metrics.train_parts) == {"teacher", "forward_backward", "optimizer"}
    assert all(v >= 0 for v in metrics.train_parts.values()) and sum(metrics.train_parts.values()) <= took
    assert metrics.train_parts["forward_backward"] > metrics.train_parts["teacher"]

    with torch.no_grad():
        rows = reference_token_logprobs(tiny_llama(0), TRAJS)
    kl, turn_kl, p = [], [], 0
    for traj in TRAJS:
        per_turn = []
        for turn in traj.turns:
            diffs = [float(rows[p + j][a]) - t for j, (a, t) in enumerate(zip(turn.action_ids, turn.teacher_logprobs, strict=True))]
            p += len(diffs)
            kl.extend(diffs)
            per_turn.append(sum(diffs) / len(diffs))
        turn_kl.append(per_turn)
    assert metrics.mean_kl == pytest.approx(sum(kl) / len(kl), rel=1e-5)
    assert metrics.turn_kl == [pytest.approx(x, rel=1e-5) for x in turn_kl]
    # one micro-batch: every sequence padded to the longest
    lens = batch.seq_lens.tolist()
    padding = len(lens) * max(lens) - sum(lens)
    assert metrics.padding_share == pytest.approx(padding / (len(lens) * max(lens)))
    assert (metrics.tokens_trained, metrics.action_tokens) == (sum(lens), len(kl))
    assert metrics.grad_norm > 0 and metrics.lr == pytest.approx(1e-2)


def test_deep_turn_share_from_an_independent_computation():
    # k3 losses are >= 0; weights w = ((1-a)/n_i + a/(T_i n_it)) / N_traj; deep: 3t >= 2 * depth
    trainer = Trainer(tiny_llama(0), *configs("k3", "progressive"), total_steps=2)
    metrics = trainer.step(build_token_batch(TRAJS), alpha=1.0)
    with torch.no_grad():
        rows = reference_token_logprobs(tiny_llama(0), TRAJS)
    deep = total = 0.0
    p = 0
    for traj in TRAJS:
        for turn in traj.turns:
            w = 1.0 / (len(TRAJS) * len(traj.turns) * len(turn.action_ids))
            for a, t in zip(turn.action_ids, turn.teacher_logprobs, strict=True):
                d = t - float(rows[p][a])
                mass = w * (math.exp(d) - d - 1)
                total += mass
                deep += mass if 3 * turn.index >= 2 * len(traj.turns) else 0.0
                p += 1
    assert metrics.deep_turn_share == pytest.approx(deep / total, rel=1e-5)


def test_sequences_and_trajectories_without_action_tokens_are_neither_run_nor_counted():
    empty_turn = Turn(index=0, observation="", prompt_ids=[3, 4, 5], action_ids=[], student_logprobs=[])
    trajs = [*TRAJS[:3], Trajectory(task_id="empty", env_name="synthetic", turns=[empty_turn]), *TRAJS[3:]]
    trainer = Trainer(tiny_llama(0), *configs("k1", "progressive"), total_steps=2)
    metrics = trainer.step(build_token_batch(trajs), alpha=0.5)
    expected = reference_loss(tiny_llama(0), TRAJS, "k1", "progressive", alpha=0.5)  # as if it were absent
    assert metrics.loss == pytest.approx(expected.item(), rel=1e-5)
    assert metrics.tokens_trained == build_token_batch(TRAJS).num_tokens


def test_rank_shares_with_global_counts_reproduce_the_single_process_weights():
    full = build_token_batch(TRAJS)
    expected = token_weights(full.traj_ids[full.loss_mask], full.turn_ids[full.loss_mask], "progressive", 0.4)
    num_tokens = full.num_action_tokens
    parts = []
    for share in (TRAJS[:2], TRAJS[2:]):  # what two ranks hold: local trajectory indices 0..n-1
        b = build_token_batch(share)
        parts.append(token_weights(b.traj_ids[b.loss_mask], b.turn_ids[b.loss_mask], "progressive", 0.4,
                                   num_trajectories=len(TRAJS), num_tokens=num_tokens))
    assert torch.allclose(torch.cat(parts), expected, rtol=1e-12)
    assert float(expected.sum()) == pytest.approx(1.0)


# the skip paths: bare torch AdamW (fp32 stage 0), ZeRO optimizer, DeepSpeed's bf16 optimizers
@pytest.mark.parametrize(("zero_stage", "dtype"), [(0, "float32"), (2, "float32"), (0, "bfloat16"), (1, "bfloat16")])
def test_nan_loss_skips_the_step_and_repeated_ones_stop_training(zero_stage, dtype):
    trainer = Trainer(tiny_llama(0), *configs("k1", zero_stage=zero_stage, max_bad_steps=2, lr_warmup_steps=2,
                                              dtype=dtype), total_steps=5)
    bad = build_token_batch(TRAJS)
    bad.teacher_logprobs[bad.loss_mask.nonzero()[3]] = float("nan")
    before = params(trainer.module)

    metrics = trainer.step(bad, alpha=0.0)
    assert metrics.skipped and math.isnan(metrics.loss)
    assert max_diff(params(trainer.module), before) == 0.0

    good = trainer.step(build_token_batch(TRAJS), alpha=0.0)
    assert not good.skipped and good.lr == pytest.approx(0.5e-2)  # the skip did not advance the schedule
    assert max_diff(params(trainer.module), before) > 1e-4

    after_good = params(trainer.module)
    trainer.step(bad, alpha=0.0)
    with pytest.raises(TrainingDiverged, match="2 optimizer steps in a row"):
        trainer.step(bad, alpha=0.0)
    assert max_diff(params(trainer.module), after_good) == 0.0


@pytest.mark.parametrize(("zero_stage", "dtype"), [(0, "float32"), (1, "float32"), (2, "float32"), (3, "float32"),
                                                (2, "bfloat16")])
def test_save_and_load_continue_exactly(tmp_path, zero_stage, dtype):
    """Every ZeRO stage and DeepSpeed's bf16 optimizer: the state files load back without running code
    (weights_only, the classes they name allowed) and the next step is the uninterrupted one's."""
    cfgs = configs("k1", zero_stage=zero_stage, lr_schedule="cosine", lr_warmup_steps=1, dtype=dtype)
    batches = [build_token_batch(random_trajectories(seed, 4)) for seed in (1, 2)]
    first = Trainer(tiny_llama(0), *cfgs, total_steps=4)
    first.step(batches[0], alpha=0.2)
    saved = params(first.module)
    first.save(tmp_path / "ckpt")
    expected = first.step(batches[1], alpha=0.6)

    resumed = Trainer(tiny_llama(seed=5), *cfgs, total_steps=4)  # different initial weights
    resumed.load(tmp_path / "ckpt")
    assert resumed.steps_taken == 1
    got = resumed.step(batches[1], alpha=0.6)
    assert got.loss == expected.loss and got.lr == expected.lr
    assert max_diff(params(resumed.module), params(first.module)) == 0.0

    hf = LlamaForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert max_diff(params(hf), saved) == 0.0


def test_clear_errors_before_any_training(tmp_path):
    with pytest.raises(ValueError, match="estimator=full needs the teacher"):
        Trainer(tiny_llama(0), *configs("full"), total_steps=2)
    with pytest.raises(ValueError, match="must not set 'optimizer'"):
        Trainer(tiny_llama(0), *configs("k1", deepspeed={"optimizer": {"type": "Adam"}}), total_steps=2)
    trainer = Trainer(tiny_llama(0), *configs("topk"), total_steps=2)
    with pytest.raises(ValueError, match="top-k"):
        trainer.step(build_token_batch(random_trajectories(0, 2)), alpha=0.0)
    with pytest.raises(FileNotFoundError, match="no trainer state"):
        trainer.load(tmp_path)


def test_a_crafted_deepspeed_state_file_is_refused_not_run(tmp_path):
    """DeepSpeed's own loader would unpickle its state files with weights_only=False; Trainer.load gives it
    the weights-only loader, so a state file whose pickle calls a function is refused before it runs."""
    import contextlib

    from tests.test_checkpoint import WritesAMarker
    from turnopd.core.checkpoint import CheckpointRefused
    from turnopd.trainer.trainer import CHECKPOINT_TAG

    trainer = Trainer(tiny_llama(0), *configs("k1"), total_steps=2)
    trainer.save(tmp_path / "ckpt")
    [state_file] = (tmp_path / "ckpt" / "deepspeed" / CHECKPOINT_TAG).glob("mp_rank_*_model_states.pt")
    marker = tmp_path / "marker"
    torch.save({"module": WritesAMarker(marker)}, state_file)
    with contextlib.suppress(Exception):  # the payload works where weights_only=False loads it
        torch.load(state_file, weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointRefused, match="mp_rank_00_model_states.pt was not loaded: it names io.open"):
        Trainer(tiny_llama(0), *configs("k1"), total_steps=2).load(tmp_path / "ckpt")
    assert not marker.exists()


def test_full_compares_heads_of_unequal_rows_on_the_shared_tokenizer_vocabulary():
    """Qwen2.5 0.5B vs 7B: one tokenizer, 151,936 vs 152,064 embedding rows. A teacher whose head has
    8 padding rows past the tokenizer's VOCAB ids gives, with vocab=VOCAB, exactly the loss of the same
    teacher without them; without the vocabulary the unequal heads are refused, naming both."""
    teacher = tiny_llama(seed=1)
    padded = copy.deepcopy(teacher)
    padded.resize_token_embeddings(VOCAB + 8)
    assert padded.get_output_embeddings().weight.shape[0] == VOCAB + 8
    losses = []
    for model, vocab in ((teacher, None), (padded, VOCAB)):
        trainer = Trainer(tiny_llama(seed=0), *configs("full", "token_mean", micro_batch_tokens=40), total_steps=2,
                          teacher_model=copy.deepcopy(model), vocab=vocab)
        losses.append(trainer.step(build_token_batch(TRAJS), alpha=0.0).loss)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    with pytest.raises(ValueError, match=rf"student's output head has {VOCAB} rows and the teacher's {VOCAB + 8}"):
        Trainer(tiny_llama(seed=0), *configs("full", "token_mean"), total_steps=2, teacher_model=copy.deepcopy(padded))
