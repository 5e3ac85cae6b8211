"""The shared-run-folder check (turnopd.orchestration.startup.check_shared_run_dir) in two gloo
processes: one folder seen by both passes and leaves nothing; two folders (two nodes' disks, each
rank its own) are refused on every rank, naming the folder and the rank that cannot see it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import child_env

WORKER = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from turnopd.config import RecipeError
from turnopd.orchestration.startup import check_shared_run_dir

dist.init_process_group("gloo")
try:
    check_shared_run_dir(Path(sys.argv[1]))
    result = "ok"
except RecipeError as exc:
    result = str(exc)
Path(sys.argv[2]).write_text(json.dumps(result))
dist.destroy_process_group()
"""


def _check_on_two_ranks(folders: list[Path], tmp_path: Path) -> list[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank, folder in enumerate(folders):
        env = {**child_env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(folder), str(tmp_path / f"result{rank}")],
                                      env=env, cwd=os.getcwd()))
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    return [json.loads((tmp_path / f"result{rank}").read_text()) for rank in range(2)]


def test_one_folder_seen_by_every_rank_passes_and_two_folders_are_refused(tmp_path: Path):
    shared = tmp_path / "runs" / "shared"
    assert _check_on_two_ranks([shared, shared], tmp_path) == ["ok", "ok"]
    assert list(shared.iterdir()) == []  # the marker is gone

    node0, node1 = tmp_path / "node0" / "runs" / "r", tmp_path / "node1" / "runs" / "r"
    results = _check_on_two_ranks([node0, node1], tmp_path)
    assert results[0] == results[1]  # every rank stops, with the same line
    assert results[0].startswith(f"run folder {node0}: rank(s) [1] do not see what rank 0 writes there; every "
                                 "rank writes into the run folder, so on several nodes it must be on a filesystem "
                                 "they all share")
