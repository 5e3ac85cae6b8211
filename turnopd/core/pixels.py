"""The pixel store: screenshots kept once, in memory, and passed around by key.

As AsyncWebRL does (microsoft/webgym, areal/utils/pixel_store.py), pixels do not travel with the
rollouts: the env worker that draws a page puts its pixels into the store and hands on a key; the
trajectories, the env pool's pipes and the generator's pipes carry only keys; the policy and the
trainer fetch the pixels they need when they build a batch; the trainer frees a step's keys after
the step, and a batch whose keys are missing is dropped (and counted), not trained on blind.

Here the store is a folder of content-addressed .npy files, on the node's shared memory
(/dev/shm) by default, so every process of a run on one node reads it (env workers, the policy, the
trainer ranks) with no broker process to keep alive; a key is the hash of the pixels, so a page
seen twice is stored once. A file is written under a temporary name and renamed (atomic): a reader
sees a whole image or none. Across nodes, point `root` at a shared file system.

With episodes still playing while a step's screenshots are freed (an asynchronous pipeline), what is
freed is what was put before the oldest playing episode began (`free_unheld`): every put, also of a
page already stored, stamps its file's time, so a page an episode drew is at least as new as the
episode. A put and a free never interleave (an advisory lock on the folder: shared by puts,
exclusive for a free), so a page cannot be stamped between a free's look at its time and its delete.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

KEY_CHARS = 32  # a 128-bit hash, hex
LOCK_FILE = ".lock"
# A file's time is the kernel's coarse clock, which may trail time.time() by a few milliseconds: a
# cut-off is taken this much earlier, so that a page drawn just after an episode began stays
CLOCK_MARGIN_S = 1.0


def default_pixel_root(run: str) -> Path:
    """/dev/shm/turnopd-pixels-<uid>/<run> where the node has a shared-memory folder, else the temp dir."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"turnopd-pixels-{os.getuid()}" / run


class PixelStore:
    """Pixels by key in a folder (see the module docstring); picklable (only its root travels)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)  # made by the first put: a store nobody writes to leaves nothing behind

    @staticmethod
    def key_of(pixels: np.ndarray) -> str:
        digest = hashlib.blake2b(digest_size=KEY_CHARS // 2)
        digest.update(f"{pixels.dtype.str}{pixels.shape}".encode())
        digest.update(np.ascontiguousarray(pixels).tobytes())
        return digest.hexdigest()

    def path(self, key: str) -> Path:
        # a key is a hex digest, never a path: a corrupt key cannot name a file outside the store
        if len(key) != KEY_CHARS or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"not a pixel-store key: {key!r} (keys are {KEY_CHARS} hex digits)")
        return self.root / f"{key}.npy"

    def put(self, pixels: np.ndarray) -> str:
        """Store the pixels (once: a key already there is only touched, so a free that keeps what
        was put after a cut-off keeps it) and return their key."""
        key = self.key_of(pixels)
        path = self.path(key)
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked(fcntl.LOCK_SH):
            try:
                os.utime(path)
                return key
            except FileNotFoundError:
                pass
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                np.save(f, np.ascontiguousarray(pixels), allow_pickle=False)
            os.replace(tmp, path)
        return key

    @contextmanager
    def _locked(self, kind: int) -> Iterator[None]:
        """The folder's advisory lock (see the module docstring); the folder must exist."""
        with open(self.root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, kind)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The keys not in the store (each once, in first-seen order)."""
        return [key for key in dict.fromkeys(keys) if not self.path(key).exists()]

    def get(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """The pixels of the keys that are in the store (a missing key is left out: ask `missing` first)."""
        found: dict[str, np.ndarray] = {}
        for key in dict.fromkeys(keys):
            try:
                found[key] = np.load(self.path(key), allow_pickle=False)
            except FileNotFoundError:
                continue
        return found

    def free(self, keys: Iterable[str], put_before: float | None = None) -> int:
        """Delete the keys' pixels, except those put (or put again) at or after `put_before` (a
        time.time(); None: delete all): an episode still playing may have drawn the same page since.
        Returns how many were deleted."""
        if not self.root.is_dir():
            return 0
        freed = 0
        with self._locked(fcntl.LOCK_EX):
            for key in dict.fromkeys(keys):
                path = self.path(key)
                try:
                    if put_before is not None and path.stat().st_mtime >= put_before:
                        continue
                    path.unlink()
                    freed += 1
                except FileNotFoundError:
                    continue
        return freed

    def keys(self) -> list[str]:
        return [p.stem for p in self.root.glob("*.npy")]

    def free_unheld(self, since: float, held: Iterable[str] = ()) -> int:
        """Free every screenshot but those put (or put again) after `since` (less CLOCK_MARGIN_S),
        a time.time() before which no episode still playing began, and the `held` keys (those of
        trajectories played but not trained yet). Returns how many were freed."""
        keep = set(held)
        return self.free([key for key in self.keys() if key not in keep], put_before=since - CLOCK_MARGIN_S)

    def clear(self) -> int:
        """Delete everything (a run starting, resuming or ending: no trajectory from before holds a
        key) and the folder itself; a later put makes it again."""
        freed = self.free(self.keys())
        shutil.rmtree(self.root, ignore_errors=True)
        return freed

    def stats(self) -> dict[str, int]:
        files = list(self.root.glob("*.npy"))
        return {"stored": len(files), "bytes": sum(f.stat().st_size for f in files)}
