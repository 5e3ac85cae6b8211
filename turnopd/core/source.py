"""Which build of TurnOPD's code ran a run: a fingerprint of the package's files, written in every start
record so that the runs of one comparison can be checked for one build of the code. A git commit would
not say it: an installed copy has none, and a commit that changes only docs or results changes no number."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def code_build() -> dict[str, str]:
    """The code that made a record's numbers: the package's version and code_fingerprint()."""
    from turnopd import __version__

    return {"version": __version__, "source": code_fingerprint()}


@functools.cache
def code_fingerprint(package: Path = PACKAGE) -> str:
    """The first 16 hex digits of a sha256 over the package's files (each file's path relative to the
    package, a NUL, its bytes, a NUL; files in path order), bytecode caches left out."""
    digest = hashlib.sha256()
    files = sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
