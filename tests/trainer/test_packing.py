"""Micro-batch packing, the LR schedule and the DeepSpeed config: pure functions, hand-worked values."""

import json
import math

import pytest
import torch

from turnopd.config import TrainerConfig
from turnopd.core.types import TokenBatch
from turnopd.trainer.deepspeed_setup import deepspeed_config
from turnopd.trainer.packing import build_micro_batch, pack_by_tokens
from turnopd.trainer.schedule import lr_factor


def test_pack_sorts_longest_first_and_respects_the_padded_budget():
    # lengths 3, 9, 4, 8, 2 with budget 18: sorted 9(1), 8(3), 4(2), 3(0), 2(4)
    # [9, 8] -> 2 rows * 9 = 18 <= 18; adding 4 -> 3 * 9 = 27 > 18, so a new group
    # [4, 3, 2] -> 3 rows * 4 = 12 <= 18
    assert pack_by_tokens([3, 9, 4, 8, 2], 18) == [[1, 3], [2, 0, 4]]


def test_pack_gives_an_oversized_sequence_its_own_micro_batch():
    assert pack_by_tokens([30, 5, 5], 10) == [[0], [1, 2]]
    assert pack_by_tokens([], 10) == []
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_by_tokens([1], 0)


def _batch() -> TokenBatch:
    # sequence 0: 4 tokens, actions at positions 2, 3; sequence 1: 3 tokens, action at position 2
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 1], dtype=torch.bool)
    n = mask.numel()
    return TokenBatch(input_ids=torch.arange(10, 10 + n), loss_mask=mask, traj_ids=torch.tensor([0] * 4 + [1] * 3),
                      turn_ids=torch.where(mask, 0, -1), old_logprobs=torch.zeros(n),
                      teacher_logprobs=torch.zeros(n), seq_lens=torch.tensor([4, 3]), num_trajectories=2)


def test_micro_batch_pads_right_and_maps_action_tokens_to_their_batch_index():
    mb = build_micro_batch(_batch(), [1, 0], pad_id=0)
    assert mb.input_ids.tolist() == [[14, 15, 16, 0], [10, 11, 12, 13]]
    assert mb.scored.tolist() == [[False, False, True, False], [False, False, True, True]]
    # action tokens of the batch in order: position 2 -> 0, 3 -> 1, 6 -> 2; rows are [seq 1, seq 0]
    assert mb.action_index.tolist() == [2, 0, 1]
    assert (mb.num_tokens, mb.num_padding) == (7, 1)


@pytest.mark.parametrize(("step", "expected"), [
    (0, 1 / 2), (1, 2 / 2),                   # warm-up over 2 steps
    (2, 1.0),                                 # cosine at progress 0
    (4, 0.5 * (1 + math.cos(math.pi * 2 / 8))),
    (9, 0.5 * (1 + math.cos(math.pi * 7 / 8))),  # last of 10 steps: progress 7/8, lr still > 0
])
def test_cosine_schedule_with_warmup(step, expected):
    assert lr_factor(step, total_steps=10, warmup_steps=2, schedule="cosine") == pytest.approx(expected)


def test_linear_and_constant_schedules():
    assert [lr_factor(k, 5, 0, "linear") for k in range(5)] == pytest.approx([1, 0.8, 0.6, 0.4, 0.2])
    assert [lr_factor(k, 5, 1, "constant") for k in range(5)] == [1.0] * 5
    with pytest.raises(ValueError, match="unknown lr schedule"):
        lr_factor(0, 5, 0, "step")


def test_deepspeed_config_merges_a_json_file_and_refuses_owned_keys(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}))
    config = deepspeed_config(TrainerConfig(zero_stage=2, grad_clip=0.5, deepspeed=str(path)), torch.float32)
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert (config["gradient_clipping"], config["gradient_accumulation_steps"]) == (0.5, 1)
    assert config["bf16"]["enabled"] is False

    with pytest.raises(ValueError, match="'optimizer'.*'scheduler'"):
        deepspeed_config(TrainerConfig(deepspeed={"optimizer": {}, "scheduler": {}}), torch.float32)
    with pytest.raises(ValueError, match="zero_optimization.stage=3"):
        deepspeed_config(TrainerConfig(zero_stage=1, deepspeed={"zero_optimization": {"stage": 3}}), torch.float32)
    with pytest.raises(FileNotFoundError, match="not found"):
        deepspeed_config(TrainerConfig(deepspeed=str(tmp_path / "missing.json")), torch.float32)
