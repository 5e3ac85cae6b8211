"""Faults: failpoints, and how a run names a full disk.

Failpoints are named places in the run where a fault can be injected on demand, for the fault suite
(tests/test_faults.py) and for anyone who wants to see what a crash at that place costs.

    TURNOPD_FAILPOINTS="trainer.optimizer_step@2=kill,checkpoint.before_rename=kill"

arms `name` to act on its `hit`-th pass in this process (default 1, counted from the process start);
the only action is `kill`: SIGKILL of this process, which is what an OOM killer, a pre-empted node or
`kill -9` does (nothing is flushed, no handler runs). Unset, a failpoint is one dict lookup.

The places (see FAILPOINTS) are the ones where a kill could lose or tear something: an episode
finished in the middle of a step's rollout, the optimizer step after the backward passes, a
checkpoint whose files are written but whose loop state is not, and one complete but not renamed.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager

FAILPOINTS = {
    "rollout.episode_done": "an episode has ended; the step's other episodes are still playing",
    "trainer.optimizer_step": "the gradients are accumulated; the optimizer has not stepped",
    "checkpoint.files_written": "the trainer's files are in the temporary folder, the loop state is not",
    "checkpoint.before_rename": "the temporary folder is complete, not yet renamed into place",
}
ENV = "TURNOPD_FAILPOINTS"


def parse_failpoints(text: str) -> dict[str, tuple[int, str]]:
    """"name[@hit]=action,..." -> {name: (hit, action)}; an unknown name, hit or action is an error
    that names it and the allowed ones."""
    armed = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        where, _, action = item.partition("=")
        name, _, hit = where.partition("@")
        if name not in FAILPOINTS:
            raise ValueError(f"${ENV}: unknown failpoint {name!r}; allowed: {', '.join(FAILPOINTS)}")
        if action != "kill":
            raise ValueError(f"${ENV}: {item!r}: the action must be 'kill'")
        if hit and not (hit.isdigit() and int(hit) >= 1):
            raise ValueError(f"${ENV}: {item!r}: the hit after '@' must be a whole number >= 1")
        armed[name] = (int(hit or 1), action)
    return armed


_armed = parse_failpoints(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}


def failpoint(name: str) -> None:
    """Pass failpoint `name`: SIGKILL this process if it is armed for this pass."""
    if name not in _armed:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == _armed[name][0]:
        os.kill(os.getpid(), signal.SIGKILL)


class DiskFull(RuntimeError):
    """A write of the run's record (metrics.jsonl, a checkpoint) found no space left on the disk."""


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded")
LOW_SPACE_BYTES = 1 << 20


def is_disk_full(exc: BaseException, path: str | os.PathLike[str]) -> bool:
    """Did `exc`, raised while writing under `path`, come from a full disk? Yes when an exception of
    its chain is an OSError with ENOSPC/EDQUOT or names it (torch.save and safetensors wrap the OS
    error in their own), or when under 1 MiB is left there (torch's zip writer says only "file
    write failed")."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS or any(w in str(seen) for w in _FULL_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(path).free < LOW_SPACE_BYTES
    except OSError:
        return False


def disk_full_error(path: str | os.PathLike[str], what: str, run_dir: str | os.PathLike[str]) -> DiskFull:
    """The error of a full disk under `path`: what was not written (`what`) and how to go on."""
    return DiskFull(f"no space left on the disk holding {path}: {what}. Free space, then continue the run "
                    f"with --resume {run_dir}")


@contextmanager
def naming_a_full_disk(path: str | os.PathLike[str], what: str, run_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Writes under `path`: an error from a full disk (is_disk_full) becomes disk_full_error's; any
    other error passes unchanged."""
    try:
        yield
    except Exception as exc:
        if not is_disk_full(exc, os.path.dirname(path) or "."):
            raise
        raise disk_full_error(path, what, run_dir) from exc
