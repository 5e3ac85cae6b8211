"""A LoRA adapter on the session's tiny model, for the LoRA teacher tests (with and without vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def lora_adapter(tiny_model_dir, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(the adapter folder PeftModel.save_pretrained wrote, that PeftModel un-merged): rank 8 on every
    linear projection of the tiny model, randomly initialized (init_lora_weights=False: B is not zero),
    so that it changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS,
                                            init_lora_weights=False)).eval()
    folder = tmp_path_factory.mktemp("adapters") / "tiny-lora"
    model.save_pretrained(folder)
    return folder, model
