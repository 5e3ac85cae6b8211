"""Trainer throughput: TurnOPD's DeepSpeed trainer vs TRL's GKDTrainer on the same model and tokens.

    python benchmarks/trainer_throughput.py [--model smollm2-135m|random] [--batch 4]
        [--prompt-len 192] [--completion-len 64] [--steps 3] [--warmup 1] [--threads 2]
        [--dtype float32|bfloat16]

Each trainer trains on the same B sequences of prompt + completion tokens (the completion is the
student's sampled answer; its tokens carry the loss) for `warmup + steps` optimizer steps, in
`--dtype` on the run's device (turnopd.core.device: the GPU when there is one, else the CPU;
bfloat16: DeepSpeed's bf16 with fp32 master weights; TRL's bf16 autocast), lr 1e-6, gradient clip
1.0, torch's fused AdamW (TRL's default), one micro-batch per step.
Rollout generation is excluded from every trainer: TRL's GKDTrainer runs on-policy (lmbda=1) with
beta=1 (reverse KL over the full vocabulary), and its `generate_on_policy_outputs` is replaced by
one returning the given completions, as TurnOPD's trainer gets them from the rollout phase.

    turnopd full   teacher in-process, full-vocabulary reverse KL (the same loss as GKD beta=1);
                   the step includes the teacher forward, like GKD's
    turnopd k1     sampled-token reverse KL; teacher log-probs come with the batch (scored in the
                   teacher phase, not timed here)
    trl gkd        GKDTrainer.train, steps timed by a callback

Reported (benchmarks/results/trainer_throughput_<dtype>.json), each the median over `--repeats`
processes per trainer, run interleaved, with the range: trained tokens/s (all prompt + completion
tokens through the student per second of a process's median optimizer step after warm-up), the ratio
to TRL's paired per repeat and MFU = 6 * params * tokens/s over the matmul
peak in the same dtype measured in the same run on the device that trains (best 2048^3 matmul on a
CPU, 8192^3 on a GPU, before and after; teacher forwards are not counted in the 6 * params). Each trainer runs in its own process, one after another, for its
peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from record import MIN_REPEATS, Summary, save_result

from turnopd.core.device import matmul_peak_flops, run_device

REPO = Path(__file__).resolve().parents[1]
TRAINERS = ("turnopd-full", "turnopd-k1", "trl-gkd")


def peak_matmul_size(device: torch.device) -> int:
    """The peak's matmul: 2048^3 is seconds' worth of work on a CPU; on a GPU it is a few
    microseconds, mostly launch, so there it is 8192^3."""
    return 8192 if device.type == "cuda" else 2048


def load_models(model: str) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """Student, teacher and tokenizer: SmolLM2-135M-Instruct (student and teacher from the same
    weights; speed does not depend on them) or a random ~60M Llama with a stand-in tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if model == "smollm2-135m":
        from turnopd.models import prepare_model

        path = prepare_model("smollm2-135m")
        student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return student, teacher, AutoTokenizer.from_pretrained(path)
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    student, teacher = LlamaForCausalLM(config), LlamaForCausalLM(config)
    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, config.vocab_size)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                        pad_token="<pad>")
    return student, teacher, tokenizer


def token_rows(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    length = args.prompt_len + args.completion_len
    return torch.randint(1, vocab, (args.batch, length), generator=g).tolist()


def run_turnopd(args: argparse.Namespace, estimator: str) -> tuple[list[float], int]:
    from turnopd.config import LossConfig, ObjectiveConfig, TrainerConfig
    from turnopd.core.types import Trajectory, Turn, build_token_batch
    from turnopd.trainer import Trainer

    student, teacher, _ = load_models(args.model)
    params = student.num_parameters()
    rows = token_rows(args, student.config.vocab_size)
    trajectories = [Trajectory(task_id=str(i), env_name="bench", turns=[Turn(
        index=0, observation="", prompt_ids=row[:args.prompt_len], action_ids=row[args.prompt_len:],
        student_logprobs=[-1.0] * args.completion_len, teacher_logprobs=[-1.5] * args.completion_len)])
        for i, row in enumerate(rows)]
    batch = build_token_batch(trajectories)
    cfg = TrainerConfig(lr=1e-6, grad_clip=1.0, dtype=args.dtype, zero_stage=0,
                        micro_batch_tokens=args.batch * (args.prompt_len + args.completion_len))
    trainer = Trainer(student, cfg, ObjectiveConfig(estimator=estimator), LossConfig(mode="token_mean"),
                      total_steps=args.warmup + args.steps, teacher_model=teacher if estimator == "full" else None)
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        metrics = trainer.step(batch, alpha=0.0)
        times.append(time.perf_counter() - start)
        assert metrics.num_micro_batches == 1 and not metrics.skipped
    return times[args.warmup:], params


def run_trl_gkd(args: argparse.Namespace) -> tuple[list[float], int]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    student, teacher, tokenizer = load_models(args.model)
    params = student.num_parameters()
    rows = token_rows(args, student.config.vocab_size)
    p = args.prompt_len

    def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
        ids = torch.tensor([e["input_ids"] for e in examples])
        labels = ids.clone()
        labels[:, :p] = -100  # the loss is on the completion
        ones = torch.ones_like(ids)
        return {"input_ids": ids, "attention_mask": ones, "labels": labels, "prompts": ids[:, :p],
                "prompt_attention_mask": ones[:, :p]}

    # On-policy (lmbda=1) with the rollout already done: the "generated" sequences are the batch's.
    GKDTrainer.generate_on_policy_outputs = staticmethod(
        lambda model, inputs, generation_config: (inputs["input_ids"], inputs["attention_mask"], inputs["labels"]))

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *_, **__) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__) -> None:
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as out:
        config = GKDConfig(output_dir=out, lmbda=1.0, beta=1.0, temperature=1.0, max_new_tokens=args.completion_len,
                           per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, max_steps=steps,
                           learning_rate=1e-6, lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch_fused",
                           use_cpu=run_device().type == "cpu", bf16=args.dtype == "bfloat16", fp16=False, report_to=[], save_strategy="no", logging_steps=10**6,
                           dataloader_num_workers=0, max_length=None, seed=0)
        trainer = GKDTrainer(model=student, teacher_model=teacher, args=config, processing_class=tokenizer,
                             data_collator=collate, train_dataset=Dataset.from_list([{"input_ids": r} for r in rows] * steps),
                             callbacks=[timer])
        trainer.train()
    return timer.times[args.warmup:], params


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    times, params = run_trl_gkd(args) if args.worker == "trl-gkd" else run_turnopd(args, args.worker.split("-")[1])
    print(json.dumps({"times": times, "params": params,
                      "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "random"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    installed = [t for t in TRAINERS if t != "trl-gkd" or importlib.util.find_spec("trl")]
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=installed, help="default: those installed")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help="processes per trainer, interleaved")
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    dtype, device = getattr(torch, args.dtype), run_device()
    torch.set_num_threads(args.threads)
    size = peak_matmul_size(device)
    peak = matmul_peak_flops(device, dtype, size)
    runs: list[dict] = []
    for repeat in range(args.repeats):  # each trainer in its own process, interleaved: A B C A B C ...
        for name in args.trainers:
            cmd = [sys.executable, __file__, "--worker", name, *sys.argv[1:]]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{name} failed:\n{done.stderr[-4000:]}")
            runs.append({"trainer": name, "repeat": repeat, **json.loads(done.stdout.strip().splitlines()[-1])})
            print(f"{name} (repeat {repeat + 1}): step times {[round(t, 2) for t in runs[-1]['times']]} s", file=sys.stderr)
    peak = max(peak, matmul_peak_flops(device, dtype, size))
    tokens = args.batch * (args.prompt_len + args.completion_len)
    params = next(r["params"] for r in runs)
    # one figure per process: its median step (contention only slows a step; the median is the typical one)
    rate = {(r["trainer"], r["repeat"]): tokens / statistics.median(r["times"]) for r in runs}
    found = []
    for name in args.trainers:
        rates = [rate[name, k] for k in range(args.repeats)]
        found += [Summary.of(f"{name}: trained tok/s", rates, "tok/s"),
                  Summary.of(f"{name}: MFU", [100 * 6 * params * x / peak for x in rates], "%"),
                  Summary.of(f"{name}: peak RSS", [r["peak_rss_gb"] for r in runs if r["trainer"] == name], "GB")]
        if name != "trl-gkd" and "trl-gkd" in args.trainers:
            found.append(Summary.of(f"{name} / trl-gkd", [rate[name, k] / rate["trl-gkd", k] for k in range(args.repeats)],
                                    "x"))
    save_result(f"trainer_throughput_{args.dtype}", f"trainer throughput, {args.model} ({params / 1e6:.1f}M params) "
                f"{args.dtype} on {device.type}, batch {args.batch} x ({args.prompt_len} + {args.completion_len}) "
                f"tokens: turnopd-full (teacher in step, full-vocab reverse KL), turnopd-k1 (sampled-token k1), trl-gkd "
                f"(GKD beta=1)", found, runs, notes=f"MFU: 6 x params x tokens/s over the {args.dtype} matmul peak "
                f"measured in the same run ({peak / 1e9:.0f} GFLOP/s, {size}^3 on {device.type}).")


if __name__ == "__main__":
    main()
