"""The headline experiment: TurnOPD vs vanilla OPD vs TCOD-F2B, and the two ablations (adaptive depth
alone, progressive loss alone), on real ALFWorld games, same models, seeds and optimizer steps.

    python benchmarks/frontier_alfworld.py                     # 1 seed, the cpu recipe (tiny models)
    python benchmarks/frontier_alfworld.py --seeds 3 trainer.steps=96

It is `turnopd sweep recipes/alfworld/turnopd.yaml` over the five methods (train games for rollouts,
valid_unseen for Avg@1; the student and teacher of recipes/alfworld/base.yaml, built on first use),
with an evaluation every `--eval-every` steps so that the frontier has points between start and end,
followed by `turnopd frontier` on the runs (markdown tables, and the plot in
runs/frontier_alfworld/frontier_alfworld-frontier.png). The runs stay in --out-dir: `turnopd
frontier runs/frontier_alfworld/*/` regenerates every figure from them alone, and an interrupted
sweep resumes where it stopped. The runs the README reports are saved in
benchmarks/results/frontier_alfworld/ (metrics and configs).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

METHODS = "turnopd,vanilla_opd,tcod,adaptive_depth_only,progressive_loss_only"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--out-dir", default="runs/frontier_alfworld")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides for every run")
    args = p.parse_args()
    command = [sys.executable, "-m", "turnopd.cli", "sweep", "recipes/alfworld/turnopd.yaml", "--methods", args.methods,
               "--seeds", str(args.seeds), "--name", "frontier_alfworld", "--out-dir", args.out_dir, "--md",
               f"eval.every={args.eval_every}", *args.overrides]
    print("$ " + " ".join(command), flush=True)
    start = time.perf_counter()
    code = subprocess.call(command)
    print(f"sweep finished in {(time.perf_counter() - start) / 60:.1f} min (exit {code})")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
