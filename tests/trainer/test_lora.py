"""LoRA students: the trainer steps only the adapter (losses against an independent full forward),
checkpoints it in peft's format, resumes exactly, syncs only the adapter to a policy, and merges
into a plain Hugging Face folder with the same outputs."""

import copy
import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import TINY_CORPUS
from tests.trainer.helpers import configs, random_trajectories, reference_loss, tiny_llama
from turnopd.config import LoraConfig, RecipeError
from turnopd.core.types import build_token_batch
from turnopd.loaders.hf_models import load_model
from turnopd.loaders.lora import (
    add_adapter,
    base_state_dict,
    load_sync_state,
    merge_adapter,
    sync_state,
    vllm_lora_rank,
)
from turnopd.models.tiny import build_tokenizer
from turnopd.trainer import Trainer

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
BATCHES = [random_trajectories(seed, 4) for seed in (1, 2, 3)]


def lora_llama(seed: int = 0) -> torch.nn.Module:
    return add_adapter(tiny_llama(seed), LORA)


def named(model, trainable: bool) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad == trainable}


def logits(model, ids=((3, 9, 14, 20, 7, 33),)) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def test_adapter_trains_alone_with_the_loss_of_a_full_forward():
    model = lora_llama()
    # hand count: rank 4 on 2 layers of q_proj (32 -> 32), v_proj (32 -> 2 kv heads x 8 = 16), down_proj (64 -> 32)
    per_layer = 4 * (32 + 32) + 4 * (32 + 16) + 4 * (64 + 32)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * per_layer == 1664
    trainer = Trainer(model, *configs("k1", "progressive", zero_stage=2), total_steps=3)
    base_before = named(trainer.module, trainable=False)
    for i, trajs in enumerate(BATCHES[:2]):
        reference = copy.deepcopy(trainer.module)  # the weights this step starts from
        expected = float(reference_loss(reference, trajs, "k1", "progressive", alpha=0.5 * i))
        got = trainer.step(build_token_batch(trajs), alpha=0.5 * i)
        assert got.loss == pytest.approx(expected, rel=1e-5)
    assert all(torch.equal(p, base_before[n]) for n, p in named(trainer.module, trainable=False).items())
    moved = named(trainer.module, trainable=True)
    assert all(float(p.abs().max()) > 0 for n, p in moved.items() if "lora_B" in n)  # B starts at 0


def test_checkpoint_is_a_peft_adapter_and_resumes_exactly(tmp_path):
    cfgs = configs("k1", zero_stage=0, lr_schedule="cosine", lr_warmup_steps=1)
    first = Trainer(lora_llama(), *cfgs, total_steps=4)
    first.step(build_token_batch(BATCHES[0]), alpha=0.2)
    first.save(tmp_path / "ckpt")
    expected = first.step(build_token_batch(BATCHES[1]), alpha=0.6)

    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    loaded = PeftModel.from_pretrained(tiny_llama(0), tmp_path / "ckpt")
    assert not torch.equal(logits(loaded), logits(tiny_llama(0)))  # the step moved the adapter
    # the DeepSpeed module state holds the adapter only (the frozen base comes from the base model)
    (state_file,) = (tmp_path / "ckpt" / "deepspeed").rglob("*model_states.pt")
    module_state = torch.load(state_file, weights_only=False)["module"]
    assert module_state and all("lora_" in name for name in module_state)

    torch.manual_seed(99)  # a different fresh adapter (A is random): the checkpoint must replace it
    resumed = Trainer(lora_llama(), *cfgs, total_steps=4)
    resumed.load(tmp_path / "ckpt")
    got = resumed.step(build_token_batch(BATCHES[1]), alpha=0.6)
    assert got.loss == expected.loss and got.lr == expected.lr
    assert all(torch.equal(p, named(first.module, True)[n]) for n, p in named(resumed.module, True).items())


def test_sync_state_is_the_adapter_and_loads_into_another_lora_model():
    source, target = lora_llama(), lora_llama()
    with torch.no_grad():
        for name, p in source.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    state = sync_state(source)
    assert len(state) == 2 * 3 * 2 and all("lora_" in name for name in state)  # 2 layers x 3 modules x (A, B)
    assert not torch.allclose(logits(source), logits(target))
    load_sync_state(target, state)
    assert torch.equal(logits(source), logits(target))
    # a full model syncs every weight
    plain = tiny_llama(3)
    assert sync_state(plain).keys() == tiny_llama(0).state_dict().keys()
    with pytest.raises(ValueError, match="adapter weights that this LoRA model does not have"):
        load_sync_state(target, {"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(4, 32)})


def test_base_state_dict_is_the_original_model(tmp_path):
    original = tiny_llama(0).state_dict()
    base = base_state_dict(lora_llama(0))
    assert base.keys() == original.keys()
    assert all(torch.equal(base[k], original[k]) for k in original)


def test_merged_model_equals_the_adapter_model(tmp_path):
    tiny_llama(0).save_pretrained(tmp_path / "base")
    model = add_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(tmp_path / "base")
    build_tokenizer(TINY_CORPUS, vocab_size=61).save_pretrained(tmp_path / "base")  # a student folder has one
    loaded, _ = load_model(tmp_path / "base", "float32", adapter=tmp_path / "adapter")  # a LoRA teacher's policy
    assert torch.equal(logits(loaded), logits(model.eval()))
    out = merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logits(merged), logits(model), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(merged), logits(tiny_llama(0)), atol=1e-3)


def test_vllm_rank_buckets():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 64, 300, 512)] == [1, 8, 8, 16, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="exceeds vLLM's largest"):
        vllm_lora_rank(513)


@pytest.mark.parametrize(("override", "message"), [
    (["trainer.zero_stage=3"], "'trainer.zero_stage': 3 with student.lora"),
    (["student.lora.target_modules=[q_proj,lm_head]"], "'student.lora.target_modules'.*output head"),
    (["student.lora.rank=0"], "'student.lora.rank': 0 is out of range"),
])
def test_recipe_refuses_what_a_lora_student_cannot_do(override, message):
    from turnopd.orchestration.recipe import load_recipe

    with pytest.raises(RecipeError, match=message):
        load_recipe("recipes/quickstart.yaml", ["student.lora.rank=8", *override])
