"""Where files live: the repository root, and task data (the recipe's `data_dir`, then $TURNOPD_DATA,
then ../shared/data)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: turnopd/, teachers/, envs/, recipes/
USER_DATA = Path.home() / ".cache" / "turnopd" / "data"  # where `turnopd data fetch` writes


class DataNotFoundError(FileNotFoundError):
    """Task data is missing: says where it looked and how to get it."""


def data_candidates(recipe_data_dir: str | None = None) -> list[Path]:
    """The places searched, in order. A folder the user named (the recipe's data_dir, $TURNOPD_DATA)
    must exist: one that does not is an error, not a place silently skipped. The recipe's data_dir is
    the only place searched: data it lacks is not silently taken from elsewhere."""
    out: list[Path] = []
    for named, where in ((recipe_data_dir, "the recipe's data_dir"), (os.environ.get("TURNOPD_DATA"), "$TURNOPD_DATA")):
        if named:
            folder = Path(named).expanduser()
            if not folder.is_dir():
                raise DataNotFoundError(f"{where} is {named!r}, which is not a folder; set it to the folder holding "
                                        "the task data (alfworld/, webshop/, multihop/) or unset it")
            out.append(folder)
    if recipe_data_dir:
        return out[:1]
    out += [Path.cwd().parent / "shared" / "data", REPO_ROOT.parent / "shared" / "data", USER_DATA]
    seen: list[Path] = []
    for p in out:
        if p.resolve() not in [s.resolve() for s in seen]:
            seen.append(p)
    return seen


def resolve_data(subdir: str, recipe_data_dir: str | None = None) -> Path:
    """The folder `<data root>/<subdir>` from the first data root that has it."""
    candidates = data_candidates(recipe_data_dir)
    for root in candidates:
        if (root / subdir).exists():
            return (root / subdir).resolve()
    if recipe_data_dir:
        raise DataNotFoundError(f"{candidates[0] / subdir} not found: the recipe's data_dir {recipe_data_dir!r} lacks "
                                f"'{subdir}'; point it at the folder holding '{subdir}' (or leave data_dir unset)")
    looked = "\n  ".join(str(root / subdir) for root in candidates)
    raise DataNotFoundError(
        f"task data '{subdir}' not found. Looked in:\n  {looked}\n"
        f"Set `data_dir` in the recipe or $TURNOPD_DATA to a folder holding '{subdir}', "
        f"or run `turnopd data fetch` (needs internet) to download it to {USER_DATA}."
    )
