"""Loading Hugging Face models and tokenizers, shared by the student's backends, the teachers and the
trainer: dtype names, a local path checked before it is taken for a hub name, the device (the run's,
turnopd.core.device, unless the caller names one), the context length, and batches of rows by length.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from turnopd.core.device import run_device
from turnopd.loaders.lora import add_adapter

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_path(path: str | os.PathLike[str]) -> None:
    """A local model path must be a directory; anything else is taken as a Hugging Face hub name."""
    text = str(path)
    if not os.path.isdir(text) and (os.path.isabs(text) or text.startswith(".")):
        raise FileNotFoundError(f"model directory not found: {text}")


def load_model(path: str | os.PathLike[str], dtype: str = "auto", adapter: str | os.PathLike[str] | None = None,
               device: str | torch.device | None = None) -> tuple[nn.Module, Any]:
    """A causal LM and its tokenizer from a Hugging Face directory (or hub name), in eval mode, on
    `device` (default: the run's); with `adapter`, a LoRA adapter folder on it (a peft model, not
    merged: a vllm policy serves it as one)."""
    from transformers import AutoTokenizer

    check_model_path(path)
    model = auto_model_class(path).from_pretrained(path, dtype=TORCH_DTYPES.get(dtype, "auto"))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.to(device or run_device()).eval(), AutoTokenizer.from_pretrained(path)


def auto_model_class(path: str | os.PathLike[str]) -> Any:
    """The transformers auto class of a model folder: a causal LM, or a vision-language model (a LLaVA:
    a vision tower before the causal LM, loaded as one)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM


def is_vision_language(path: str | os.PathLike[str]) -> bool:
    """Whether the model folder's config has a vision tower (a VLM, e.g. `prepare: tiny_vlm`)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def image_tokens_of(config: Any) -> int:
    """The prompt positions one image fills in a LLaVA-style model: the (image_size / patch_size)^2
    patches of its vision tower, less the first under vision_feature_select_strategy "default" (LLaVA
    drops it, a CLIP tower's CLS position); 0 for a model without a vision tower."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return 0
    return (vision.image_size // vision.patch_size) ** 2 - (getattr(config, "vision_feature_select_strategy", "") == "default")


def length_batches(lengths: list[int], *, max_batch_tokens: int | None = None,
                   max_rows: int | None = None) -> list[list[int]]:
    """Indices grouped into batches of at most `max_rows` rows and `max_batch_tokens` padded tokens
    (rows x longest); sequences are taken longest first, so that a batch pads little. A sequence
    longer than the token budget gets a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        last = batches[-1] if batches else None
        if (last and (max_rows is None or len(last) < max_rows)
                and (max_batch_tokens is None or lengths[last[0]] * (len(last) + 1) <= max_batch_tokens)):
            last.append(i)
        else:
            batches.append([i])
    return batches


def model_positions(config: Any) -> int | None:
    """The model's position limit (a vision-language model's is its text model's)."""
    text = getattr(config, "text_config", None)
    return getattr(config, "max_position_embeddings", None) or getattr(text, "max_position_embeddings", None)


def model_max_length(model: nn.Module, tokenizer: Any) -> int:
    """The context length: the model's position limit, or the tokenizer's when it is smaller."""
    limit = model_positions(model.config) or 10**9
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if tok_limit and tok_limit < 10**8:  # tokenizers without a limit report ~1e30
        limit = min(limit, int(tok_limit))
    return int(limit)


def resolve_dtype(name: str) -> torch.dtype:
    """A recipe's dtype name (trainer.dtype, student.dtype) as a torch dtype. `auto`: bf16 on a GPU
    that supports it, fp32 otherwise (the recipes' choices keep float16 out of trainer.dtype)."""
    if name == "auto":
        on_bf16_gpu = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if on_bf16_gpu else torch.float32
    if name in ("float32", "bfloat16", "float16"):
        return getattr(torch, name)
    raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")


def load_student(path: str | os.PathLike[str], dtype: str, lora: Any = None,
                 device: str | torch.device | None = None) -> tuple[nn.Module, Any]:
    """The student to train or to generate with, in `student.dtype` (as the trainer reads `auto`), on
    `device` (default: the run's, the GPU DeepSpeed trains on), with a fresh LoRA adapter when `lora`
    (a turnopd.config.LoraConfig) is given, and its tokenizer."""
    from transformers import AutoTokenizer

    model = auto_model_class(path).from_pretrained(path, dtype=resolve_dtype(dtype)).to(device or run_device())
    return (model if lora is None else add_adapter(model, lora)), AutoTokenizer.from_pretrained(path)
