"""Files derived from task data (search indexes, tagged titles), built once per machine and cached.

They live under `cache_root()`: $TURNOPD_CACHE, else ~/.cache/turnopd. An entry's folder is named
by a hash of what it was built from, so changed data gets a new entry. Concurrent builders never
clash: each builds in a private temporary folder and renames it into place (the first rename wins).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Where built indexes and other derived files are cached."""
    return Path(os.environ.get("TURNOPD_CACHE", Path.home() / ".cache" / "turnopd")).expanduser()


def content_key(*parts: str | bytes) -> str:
    """A short hash naming a cache entry: sha256 over the parts."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, built by `build(folder)` into a temporary sibling folder and renamed into place
    unless it exists already. Safe when several processes build it at the same time."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        build(scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
