"""Compare two folders of records written by benchmarks/same_records/run_cases.py (one code build each):
every field equal, floats to rel 1e-5 / abs 1e-7 (the tolerance of tests/test_distill.py's same-run
checks: generation batches requests as they come, which moves log-probs in the 7th digit), timing
fields left out. Prints each difference and their count.

    python benchmarks/same_records/compare.py BEFORE AFTER
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

TIMING = ("train_parts", "_time_s", "step_time", "busy", "phases")


def differences(x: Any, y: Any, path: str) -> list[str]:
    if isinstance(x, dict) and isinstance(y, dict):
        out = []
        for key in sorted(set(x) | set(y)):
            if any(t in key for t in TIMING):
                continue
            if key not in x or key not in y:
                out.append(f"{path}.{key}: only in {'before' if key in x else 'after'}")
            else:
                out += differences(x[key], y[key], f"{path}.{key}")
        return out
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            return [f"{path}: {len(x)} items vs {len(y)}"]
        return [d for i, (u, v) in enumerate(zip(x, y, strict=True)) for d in differences(u, v, f"{path}[{i}]")]
    if isinstance(x, float) or isinstance(y, float):
        same = x is not None and y is not None and (
            math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-7) or (math.isnan(x) and math.isnan(y)))
        return [] if same else [f"{path}: {x} vs {y}"]
    return [] if x == y else [f"{path}: {x!r} vs {y!r}"]


def main(before: Path, after: Path) -> int:
    found = []
    for file in sorted(before.glob("*.json")):
        other = after / file.name
        found += differences(json.loads(file.read_text()), json.loads(other.read_text()), file.stem) \
            if other.exists() else [f"{file.stem}: missing after"]
    print("\n".join(found))
    print(f"{len(found)} differences in {len(list(before.glob('*.json')))} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
