"""A few trainer steps on this rank's share of a fixed global batch (run by test_data_parallel.py).

    python -m tests.trainer.dp_worker OUT_DIR ZERO_STAGE                     (one plain process)
    torchrun --standalone --nproc_per_node 2 -m tests.trainer.dp_worker OUT_DIR ZERO_STAGE

Writes OUT_DIR/metrics.json (rank 0) and the final student via Trainer.save to OUT_DIR/ckpt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.trainer.helpers import configs, random_trajectories, tiny_llama
from turnopd.core.distributed import rank_and_world
from turnopd.core.types import build_token_batch
from turnopd.trainer import Trainer

STEPS = 3
GLOBAL_BATCH = random_trajectories(seed=11, count=7)
# Uneven contiguous shares: rank 0 holds 5 trajectories and rank 1 two, so rank 1 has fewer
# micro-batches and must run padding ones.
SHARES = {1: [(0, 7)], 2: [(0, 5), (5, 7)]}


def main(out_dir: Path, zero_stage: int) -> None:
    rank, world = rank_and_world()
    start, end = SHARES[world][rank]
    batch = build_token_batch(GLOBAL_BATCH[start:end])
    trainer = Trainer(tiny_llama(0), *configs("k1", "progressive", zero_stage=zero_stage, micro_batch_tokens=40,
                                              lr_schedule="cosine", lr_warmup_steps=1), total_steps=STEPS)
    records = []
    for k in range(STEPS):
        m = trainer.step(batch, alpha=k / (STEPS - 1))
        records.append({key: getattr(m, key) for key in ("loss", "grad_norm", "lr", "mean_kl", "deep_turn_share", "turn_kl",
                                                "action_tokens", "tokens_trained", "num_micro_batches")})
    trainer.save(out_dir / "ckpt")
    if rank == 0:
        (out_dir / "metrics.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
