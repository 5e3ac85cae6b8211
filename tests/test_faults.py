"""Faults on a real full disk (a tmpfs of a few hundred KB mounted for the test) and the failpoints'
grammar. The whole run under each fault, with SIGKILLs at each failpoint and a disk that fills
while a real run writes: tests/test_distill.py."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from turnopd.core import checkpoint as ckpt
from turnopd.core.faults import DiskFull, is_disk_full, parse_failpoints
from turnopd.core.metrics import MetricsWriter, read_metrics


@contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (needs the right to mount: root, as in CI here)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk: Path, leave_bytes: int = 0) -> Path:
    """Fill `disk` with one file until at most `leave_bytes` are free; returns the file."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        chunk = b"\0" * 4096
        try:
            while True:
                if shutil.disk_usage(disk).free <= leave_bytes:
                    break
                f.write(chunk)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_failpoints_grammar():
    assert parse_failpoints("") == {}
    assert parse_failpoints("trainer.optimizer_step@2=kill, checkpoint.before_rename=kill") == {
        "trainer.optimizer_step": (2, "kill"), "checkpoint.before_rename": (1, "kill")}
    with pytest.raises(ValueError, match=r"unknown failpoint 'trainer\.step'; allowed: rollout\.episode_done"):
        parse_failpoints("trainer.step=kill")
    with pytest.raises(ValueError, match="the action must be 'kill'"):
        parse_failpoints("trainer.optimizer_step=raise")
    with pytest.raises(ValueError, match="whole number >= 1"):
        parse_failpoints("trainer.optimizer_step@0=kill")


def test_disk_full_is_recognized_through_wrapping_errors(tmp_path):
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path)  # tmp_path has room
    wrapped = RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")  # safetensors
    assert is_disk_full(wrapped, tmp_path)
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer, tmp_path)
    assert not is_disk_full(ValueError("bad shape"), tmp_path)


def test_metrics_on_a_full_disk_end_with_the_last_complete_record(tmp_path):
    with small_disk(tmp_path / "disk", "64k") as disk:
        writer = MetricsWriter(disk / "metrics.jsonl")
        written, padding = 0, "x" * 900  # records of 936-937 bytes
        with pytest.raises(DiskFull, match=r"no space left on the disk holding .*metrics\.jsonl: its train record "
                                           r"of step (\d+) was not written .* --resume "):
            while True:
                writer.write({"kind": "train", "step": written + 1, "pad": padding})
                written += 1
        writer.close()
        sizes = [len(json.dumps({"kind": "train", "step": s, "pad": padding})) + 1 for s in range(1, 100)]
        fitting = max(n for n in range(len(sizes)) if sum(sizes[:n]) <= 64 * 1024)  # the whole 16 pages: 69
        assert written == fitting
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a torn line would warn
            records = read_metrics(disk / "metrics.jsonl")
        assert [r["step"] for r in records] == list(range(1, written + 1))
        assert (disk / "metrics.jsonl").stat().st_size == sum(sizes[:written])  # the failed record cut off


class FilesTrainer:
    """Writes `size` bytes of tensors where the real Trainer.save writes its student and optimizer
    (the real trainer on a full disk: tests/test_distill.py::test_a_disk_that_fills_stops_the_run...)."""

    def __init__(self, size: int):
        self.size = size

    def save(self, directory: Path) -> None:
        torch.save(torch.zeros(self.size // 4, dtype=torch.float32), directory / "student.pt")


class FilesTokenizer:
    def save_pretrained(self, directory: Path) -> None:
        (directory / "tokenizer.json").write_text("{}")


def test_a_checkpoint_the_disk_cannot_hold_is_absent_and_gives_its_space_back(tmp_path):
    with small_disk(tmp_path / "disk", "1m") as run_dir:
        first = ckpt.save_checkpoint(run_dir, 1, FilesTrainer(200_000), FilesTokenizer(), {"x": 1}, keep_last=3)
        free = shutil.disk_usage(run_dir).free
        with pytest.raises(DiskFull, match=r"checkpoint step_000002 could not be written .* its partial folder was "
                                           r"removed, and the last complete checkpoint is step_000001\. Free space, then "
                                           r"continue the run with --resume "):
            ckpt.save_checkpoint(run_dir, 2, FilesTrainer(2_000_000), FilesTokenizer(), {"x": 2}, keep_last=3)
        assert ckpt.list_checkpoints(run_dir) == [first]
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]  # no partial folder
        assert shutil.disk_usage(run_dir).free == free  # its space is given back
        assert ckpt.load_loop_state(first) == {"x": 1, "step": 1}
        # with room again, the same step is written and the older one kept
        ckpt.save_checkpoint(run_dir, 2, FilesTrainer(200_000), FilesTokenizer(), {"x": 2}, keep_last=3)
        assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step_000001", "step_000002"]


def test_leftovers_of_a_killed_write_or_delete_are_ignored_then_removed(tmp_path):
    run_dir = tmp_path / "run"
    ckpt.save_checkpoint(run_dir, 1, FilesTrainer(1000), FilesTokenizer(), {}, keep_last=2)
    root = run_dir / "checkpoints"
    # a kill after the files were written (no loop state), and one during a delete of a complete one
    (root / ".tmp-step_000002").mkdir()
    (root / ".tmp-step_000002" / "student.pt").write_bytes(b"half")
    (root / ".old-step_000000").mkdir()
    (root / ".old-step_000000" / ckpt.LOOP_STATE).write_text('{"step": 0}')
    assert [p.name for p in ckpt.list_checkpoints(run_dir)] == ["step_000001"]
    ckpt.save_checkpoint(run_dir, 2, FilesTrainer(1000), FilesTokenizer(), {}, keep_last=2)
    ckpt.save_checkpoint(run_dir, 3, FilesTrainer(1000), FilesTokenizer(), {}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000003"]
