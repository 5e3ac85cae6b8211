"""One trainer step with an update per 4 turn rows on this rank's share of a fixed global batch, with
k1_decoupled (its proximal forward before the first update), under ZeRO-3 (run by
tests/test_baselines.py).

    torchrun --standalone --nproc_per_node 2 -m tests.trainer.dp_rows_worker OUT_DIR

Writes OUT_DIR/rank<r>.json: the step's metrics and the sum of the student's parameters.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from tests.trainer.dp_worker import GLOBAL_BATCH, SHARES
from tests.trainer.helpers import configs, tiny_llama
from turnopd.core.distributed import rank_and_world
from turnopd.core.types import build_token_batch
from turnopd.trainer import Trainer


def main(out_dir: Path) -> None:
    rank, world = rank_and_world()
    start, end = SHARES[world][rank]
    trainer_cfg, objective, loss_cfg = configs("k1_decoupled", "turn_row_mean", zero_stage=3, micro_batch_tokens=40,
                                               turn_rows_per_update=4)
    trainer = Trainer(tiny_llama(0), trainer_cfg, dataclasses.replace(objective, clip_eps=0.2, dual_clip=3.0,
                                                                      behave_weight_cap=5.0), loss_cfg, total_steps=1)
    metrics = trainer.step(build_token_batch(GLOBAL_BATCH[start:end]), alpha=0.0)
    with trainer.gathered_parameters() as model:
        total = float(sum(p.detach().double().sum() for p in model.parameters()))
    (out_dir / f"rank{rank}.json").write_text(json.dumps({
        "optimizer_updates": metrics.optimizer_updates, "loss": metrics.loss, "skipped": metrics.skipped,
        "rows": sum(1 for traj in GLOBAL_BATCH[start:end] for turn in traj.turns if turn.action_ids),
        "parameter_sum": total}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
