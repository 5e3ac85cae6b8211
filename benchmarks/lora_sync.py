"""LoRA student vs full fine-tuning on SmolLM2-135M: optimizer-step time and weight-sync time.

    python benchmarks/lora_sync.py [--rank 16] [--repeats 3] [--batch 8] [--prompt-len 384]
        [--action-len 64] [--threads 2] [--no-vllm]

Run in the vLLM venv (README, "ci:install-vllm"); `--no-vllm` measures the trainer and the
generator-process copy only. Both students train the same batch with the same k1 loss in fp32
under DeepSpeed ZeRO-0 on CPU (the LoRA one: rank `--rank` on every linear layer of the decoder,
the base frozen). Per repeat, after one warm-up:

    step       one Trainer.step on the batch (forward, backward, optimizer)
    vllm sync  VLLMPolicy.update_weights(student): every weight reloaded in place (full) vs the
               adapter written and reloaded as vLLM's LoRA adapter (lora)
    shared     the generator-process path (pipeline one_step_off/pool): SharedWeights.write of what
               is synced (all weights vs the adapter's tensors), and its size

Printed: the median and range over the repeats of each, and the median of the paired ratios
full / lora (a step's ratio pairs repeat i of each). Numbers depend on the machine; the ratio is what
this script is for.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from record import Summary, save_result

from turnopd.config import LoraConfig, LossConfig, ObjectiveConfig, PolicyConfig, TrainerConfig
from turnopd.core.types import Trajectory, Turn, build_token_batch
from turnopd.loaders.lora import add_adapter, sync_state
from turnopd.models import prepare_model
from turnopd.orchestration.pipeline.shared_weights import SharedWeights
from turnopd.trainer import Trainer


def batch_of(vocab: int, count: int, prompt_len: int, action_len: int, seed: int = 0):
    rng = random.Random(seed)
    trajectories = [Trajectory(task_id=f"t{i}", env_name="bench", turns=[Turn(
        index=0, observation="", prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
        action_ids=[rng.randrange(vocab) for _ in range(action_len)],
        student_logprobs=[-rng.uniform(0.5, 4.0) for _ in range(action_len)],
        teacher_logprobs=[-rng.uniform(0.5, 4.0) for _ in range(action_len)])]) for i in range(count)]
    return build_token_batch(trajectories)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_and_share(kind: str, path, args, batch) -> tuple[torch.nn.Module, dict[str, object]]:
    """Step times and SharedWeights copies of one student; returns it trained, for the vLLM sync."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if kind == "lora":
        model = add_adapter(model, LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer = Trainer(model, TrainerConfig(lr=1e-5, micro_batch_tokens=args.batch * (args.prompt_len + args.action_len)),
                      ObjectiveConfig(estimator="k1"), LossConfig(mode="token_mean"), total_steps=args.repeats + 1)
    steps = [timed(lambda: trainer.step(batch, alpha=0.0)) for _ in range(args.repeats + 1)][1:]
    shared = SharedWeights(trainer.module, version=0)
    synced_bytes = sum(t.numel() * t.element_size() for t in sync_state(trainer.module).values())
    writes = [timed(lambda: shared.write(trainer.module, version=1)) for _ in range(args.repeats + 1)][1:]
    return trainer.module, {"trainable_parameters": trainable, "synced_mb": synced_bytes / 1e6, "step_s": steps,
                            "shared_write_s": writes}


def vllm_syncs(student: torch.nn.Module, tokenizer, args) -> list[float]:
    from turnopd.rollout import make_policy

    policy = make_policy(PolicyConfig(backend="vllm", options={"max_model_len": 1024}), student,
                         tokenizer=tokenizer, dtype="float32")
    try:
        return [timed(lambda: policy.update_weights(student)) for _ in range(args.repeats + 1)][1:]
    finally:
        policy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=384)
    parser.add_argument("--action-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer

    path = prepare_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = batch_of(len(tokenizer), args.batch, args.prompt_len, args.action_len)
    # Both trainers before any vLLM engine: vLLM's start re-initializes torch.distributed's groups, and a
    # DeepSpeed engine created after it finds its own group unregistered.
    students, results = {}, {}
    for kind in ("full", "lora"):
        students[kind], results[kind] = train_and_share(kind, path, args, batch)
    if not args.no_vllm:
        for kind in ("full", "lora"):
            results[kind]["vllm_sync_s"] = vllm_syncs(students[kind], tokenizer, args)
    full, lora = results["full"], results["lora"]
    found = []
    for key, label in (("step_s", "optimizer step"), ("vllm_sync_s", "vLLM weight sync"),
                       ("shared_write_s", "generator-process copy (SharedWeights.write)")):
        if key in full:
            found += [Summary.of(f"{label}, {kind}", results[kind][key], "s") for kind in ("full", "lora")]
            found.append(Summary.of(f"{label}, full / LoRA", [a / b for a, b in zip(full[key], lora[key], strict=True)],
                                    "x"))
    save_result("lora_sync", f"LoRA student (rank {args.rank}, all linear layers) vs full fine-tuning, SmolLM2-135M "
                f"fp32, batch {args.batch} x ({args.prompt_len} + {args.action_len}) tokens, k1, ZeRO-0", found,
                [results], notes=f"{lora['trainable_parameters'] / 1e6:.2f}M of {full['trainable_parameters'] / 1e6:.1f}M "
                f"parameters train; {full['synced_mb']:.0f} MB synced a step in full, {lora['synced_mb']:.1f} MB with LoRA.")


if __name__ == "__main__":
    main()
