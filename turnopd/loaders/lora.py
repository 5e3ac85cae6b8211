"""LoRA students (peft), shared by the trainer, the rollout backends and `turnopd model merge`.

A LoRA student is a `peft.PeftModel` around the Hugging Face model: only the adapter's matrices
train. What a rollout policy needs to follow the trainer is then the adapter alone (`sync_state`):
the transformers backend loads it into its own PeftModel, vLLM loads it as a LoRA adapter over the
base weights it already holds. A checkpoint's student folder is the adapter as
`PeftModel.save_pretrained` writes it (`PeftModel.from_pretrained(base, folder)` loads it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from turnopd.config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks in 0.32; a vLLM test checks they agree)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def add_adapter(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """`model` with a fresh LoRA adapter (B = 0, so it starts as the base model); the base frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = "all-linear" if list(lora.target_modules) == ["all-linear"] else list(lora.target_modules)
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                            task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_adapter_model(model: Any) -> bool:
    from peft import PeftModel  # imported when used: it takes a second

    return isinstance(model, PeftModel)


def adapter_rank(model: nn.Module) -> int:
    return int(model.peft_config["default"].r)


def sync_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a policy needs to follow the trainer: a LoRA student's adapter tensors (under peft's saved
    names), every weight of any other model."""
    if is_adapter_model(model):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    return model.state_dict()


def load_sync_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy what `sync_state` returned into a model of the same kind, in place."""
    if not is_adapter_model(model):
        model.load_state_dict(state)
        return
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise ValueError(f"adapter weights that this LoRA model does not have: {result.unexpected_keys[:5]}")


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA model's frozen base weights under the base model's own names (peft wraps each adapted
    layer: `q_proj.weight` is stored as `q_proj.base_layer.weight`, beside `q_proj.lora_A...`)."""
    return {name.replace(".base_layer.", "."): t for name, t in model.get_base_model().state_dict().items()
            if ".lora_" not in name}


def save_base(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """The base model of a LoRA model as a Hugging Face folder (what vLLM serves the adapter on)."""
    model.get_base_model().save_pretrained(directory, state_dict=base_state_dict(model))


def write_adapter(config: Any, state: dict[str, torch.Tensor], directory: Path) -> None:
    """An adapter folder vLLM's LoRA loader reads: the adapter's peft config and `state` (from
    sync_state). Written to a temporary name and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / ADAPTER_CONFIG).is_file():
        config.save_pretrained(str(directory))
    tmp = directory / f".{ADAPTER_WEIGHTS}"
    save_file({name: t.detach().contiguous() for name, t in state.items()}, str(tmp))
    os.replace(tmp, directory / ADAPTER_WEIGHTS)


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of this rank."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def is_adapter_folder(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def merge_adapter(adapter_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Fold an adapter folder into its base model's weights and write a plain Hugging Face folder
    (with the adapter folder's tokenizer where it has one, else the base's)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not is_adapter_folder(adapter_dir):
        raise FileNotFoundError(f"{adapter_dir} holds no LoRA adapter ({ADAPTER_CONFIG} missing)")
    base_path = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    if not base_path or not Path(base_path).is_dir():
        raise FileNotFoundError(f"the adapter's base model folder {base_path!r} (base_model_name_or_path in "
                                f"{adapter_dir / ADAPTER_CONFIG}) does not exist")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype="auto")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir)
    has_tokenizer = any((adapter_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    AutoTokenizer.from_pretrained(adapter_dir if has_tokenizer else base_path).save_pretrained(out_dir)
    return out_dir
