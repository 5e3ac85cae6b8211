"""Student generation with the transformers backend: rows batched by prompt length (what
TransformersPolicy.generate does) vs batches in the order the prompts came (what it did before),
side by side in one run on the same model and prompts.

    python benchmarks/generation_batching.py        # the WebShop teacher (turnopd sft recipes/webshop/teacher_sft.yaml)
    python benchmarks/generation_batching.py --model ~/.cache/turnopd/models/smollm2-135m --prompts 32

Prompts are real WebShop turns (the expert's episodes on train goals, rendered with the recipe's
template and the model's chat template: search pages, result pages and item pages of very different
lengths), sampled with a fixed seed; greedy decoding as in an evaluation, `policy.max_new_tokens`
and stop strings from the recipe, batches of `--batch-size` rows. Every row of a batch is padded to
the batch's longest prompt; grouping rows of similar length pads less. Each side runs `--repeats`
times, alternating, and reports its median.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from record import MIN_REPEATS, Summary, save_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/webshop/teacher_sft.yaml", help="SFT recipe: env, template, policy")
    parser.add_argument("--model", default="runs/teachers/webshop", help="model folder (default: the WebShop teacher)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="policy.max_batch_size")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    args = parser.parse_args()

    import torch

    from envs import make_env_spec
    from envs.demonstrations import collect_demonstrations
    from turnopd.orchestration.sft import demo_examples, load_sft_recipe
    from turnopd.rollout import POLICY_BACKENDS, SamplingParams
    from turnopd.rollout.transformers_backend import length_batches

    model = Path(args.model).expanduser()
    if not model.is_dir():
        raise SystemExit(f"no model at {model}: build the WebShop teacher (turnopd sft {args.recipe}) or pass --model")
    cfg = load_sft_recipe(args.recipe, [f"policy.max_batch_size={args.batch_size}"])
    spec = make_env_spec(cfg.env, cfg.data_dir)
    demos = collect_demonstrations(spec, cfg.env, cfg.demos.split or cfg.env.train_split, cfg.demos.episodes, cfg.seed)
    policy = POLICY_BACKENDS.get("transformers")(str(model), cfg.policy, dtype=args.dtype, seed=0)
    examples = demo_examples(demos, spec, cfg.env, policy.tokenizer)
    prompts = [ex.prompt_ids for ex in random.Random(0).sample(examples, min(args.prompts, len(examples)))]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=cfg.policy.max_new_tokens, stop=tuple(cfg.policy.stop))

    def in_arrival_order() -> list:  # the loop generate() ran before: consecutive chunks of max_batch_size rows
        out = []
        for start in range(0, len(prompts), args.batch_size):
            out.extend(policy._generate_batch(prompts[start : start + args.batch_size], sampling))
        return out

    def by_length() -> list:
        return [samples[0] for samples in policy.generate(prompts, sampling)]

    def padded(batches: list[list[int]]) -> int:
        return sum(len(batch) * max(len(prompts[i]) for i in batch) for batch in batches)

    arrival = [list(range(s, min(s + args.batch_size, len(prompts)))) for s in range(0, len(prompts), args.batch_size)]
    sides = {"arrival order": (in_arrival_order, padded(arrival)),
             "by length": (by_length, padded(length_batches([len(p) for p in prompts], max_rows=args.batch_size)))}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, list] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, (run, _) in sides.items():
                start = time.perf_counter()
                outputs[name] = run()
                seconds[name].append(time.perf_counter() - start)

    lengths = sorted(len(p) for p in prompts)
    same = sum(a.token_ids == b.token_ids for a, b in zip(*outputs.values(), strict=True))
    generated = {name: sum(len(g.token_ids) for g in outputs[name]) for name in sides}
    found = [Summary.of(f"{name}: generated tok/s ({pad} padded prompt tokens)",
                        [generated[name] / t for t in seconds[name]], "tok/s") for name, (_, pad) in sides.items()]
    found.append(Summary.of("by length / arrival order", [a / b for a, b in zip(seconds["arrival order"],
                                                                                 seconds["by length"], strict=True)], "x"))
    save_result("generation_batching", f"student generation (transformers): rows batched by prompt length vs in "
                f"arrival order ({len(prompts)} WebShop prompts of {lengths[0]}-{lengths[-1]} tokens, {model.name} "
                f"{args.dtype}, batches of {args.batch_size}, greedy)", found,
                [{"side": name, "seconds": seconds[name], "generated_tokens": generated[name]} for name in sides],
                notes=f"{same}/{len(prompts)} completions token for token the same (others differ by {args.dtype} "
                      "rounding under a different padding).")


if __name__ == "__main__":
    main()
