"""`turnopd model prepare NAME`: build a model that runs here (see turnopd.models), once.
`turnopd model merge RUN`: fold a LoRA run's adapter into its base, as a plain Hugging Face folder."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from turnopd.core.checkpoint import list_checkpoints
from turnopd.loaders.lora import is_adapter_folder, merge_adapter
from turnopd.models import (
    MODEL_PREPARERS,
    ModelPrepareError,
    default_model_dir,
    prepare_model,
    read_build_info,
)

# Size options of the tiny preparation (turnopd.models.tiny.build_tiny_model), as --flags.
TINY_SIZE_OPTIONS = {"arch": str, "vocab_size": int, "hidden_size": int, "num_layers": int, "num_heads": int,
                     "num_kv_heads": int, "intermediate_size": int, "max_position_embeddings": int, "seed": int}


def _key_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key, value


def tiny_options(args: argparse.Namespace) -> dict[str, Any]:
    """The preparation options the command line gave (only those given, so that a rerun with the
    same flags finds the same prepared folder)."""
    options: dict[str, Any] = {k: getattr(args, k) for k in TINY_SIZE_OPTIONS if getattr(args, k) is not None}
    if args.tie_word_embeddings:
        options["tie_word_embeddings"] = True
    if args.tokenizer:
        return {**options, "tokenizer": args.tokenizer}
    env: dict[str, Any] = {"name": args.env}
    if args.task_types:
        env["task_types"] = args.task_types.split(",")
    if args.env_option:
        env["options"] = dict(args.env_option)
    options["env"] = env if len(env) > 1 else args.env
    if args.data_dir:
        options["data_dir"] = args.data_dir
    if args.corpus_episodes is not None:
        options["corpus_episodes"] = args.corpus_episodes
    return options


def prepare(args: argparse.Namespace) -> int:
    if args.name not in MODEL_PREPARERS:
        print(f"error: unknown model {args.name!r}; choose from {', '.join(MODEL_PREPARERS.names())}", file=sys.stderr)
        return 2
    options = tiny_options(args) if args.name == "tiny" else {}
    out = args.out or default_model_dir(args.name)
    start = time.perf_counter()
    try:
        path = prepare_model(args.name, out, **options)
    except (ModelPrepareError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = read_build_info(path) or {}
    params = info.get("parameters")
    print(f"{args.name} ready in {path}" + (f" ({params / 1e6:.2f}M parameters)" if params else "")
          + f"; {time.perf_counter() - start:.1f} s")
    return 0


def merge(args: argparse.Namespace) -> int:
    """RUN: a run folder (its newest checkpoint is merged) or one checkpoint folder."""
    source = Path(args.run).expanduser()
    checkpoints = list_checkpoints(source)
    adapter = checkpoints[-1] if checkpoints else source
    if not is_adapter_folder(adapter):
        where = f"its newest checkpoint {adapter}" if checkpoints else f"{source} (no checkpoints/ in it either)"
        print(f"error: {where} holds no LoRA adapter (adapter_config.json); only a run with student.lora has "
              "one to merge (a full fine-tuning checkpoint is a Hugging Face folder already)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (source if checkpoints else adapter.parent.parent) / "merged"
    start = time.perf_counter()
    try:
        merge_adapter(adapter, out)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {adapter} into {out}; {time.perf_counter() - start:.1f} s")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="build models that run without a hub")
    model_sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    q = model_sub.add_parser("prepare", help="build a model once (tiny from an env's text, or smollm2-135m)",
                             description="Prepare a model folder (Hugging Face format). Rerunning with the same "
                                         "options finds it and does nothing.")
    q.add_argument("name", help="a model preparation: tiny | smollm2-135m | tiny_vlm | sft (options other than tiny's "
                                "are a recipe's prepare_options)")
    q.add_argument("--out", help="folder to write (default ~/.cache/turnopd/models/NAME)")
    tiny = q.add_argument_group("tiny")
    tiny.add_argument("--env", default="alfworld", help="env whose text the tokenizer is built from")
    tiny.add_argument("--task-types", help="comma-separated task types of the env (default: all)")
    tiny.add_argument("--env-option", action="append", type=_key_value, metavar="KEY=VALUE",
                      help="env option (e.g. expert=handcoded); repeatable")
    tiny.add_argument("--data-dir", help="task data root (default: $TURNOPD_DATA, then ../shared/data)")
    tiny.add_argument("--corpus-episodes", type=int, help="expert episodes whose text builds the tokenizer")
    tiny.add_argument("--tokenizer", help="reuse this model folder's tokenizer instead of building one")
    for name, kind in TINY_SIZE_OPTIONS.items():
        tiny.add_argument("--" + name.replace("_", "-"), type=kind)
    tiny.add_argument("--tie-word-embeddings", action="store_true")
    q.set_defaults(func=prepare)
    m = model_sub.add_parser("merge", help="fold a LoRA run's adapter into its base model",
                             description="Merge the adapter of a LoRA run (student.lora) into the student's base "
                                         "weights and write a plain Hugging Face folder.")
    m.add_argument("run", metavar="RUN", help="run folder (its newest checkpoint) or a checkpoint folder")
    m.add_argument("--out", help="folder to write (default RUN/merged)")
    m.set_defaults(func=merge)
