"""What the benchmarks publish (benchmarks/record.py) and the page generated from it (benchmarks/table.py)."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their siblings as top-level modules

import record  # noqa: E402
import table  # noqa: E402


def test_a_summary_is_the_median_and_range_of_its_repeats():
    s = record.Summary.of("vLLM / transformers", [4.3, 3.6, 4.09], "x")
    assert (s.median, s.low, s.high, s.repeats) == (4.09, 3.6, 4.3, 3)
    assert s.text() == "4.09x (3.60-4.30)"
    even = record.Summary.of("rate", [10.0, 30.0, 20.0, 40.0], "tok/s")
    assert even.median == 25.0  # the mean of the middle two
    assert even.text() == "25.0 tok/s (10.0-40.0)"
    assert record.Summary.of("share", [99.71, 99.75], "%").text() == "99.7% (99.7-99.8, only 2 repeats)"
    assert record.Summary.of("big", [1234.4, 1300.0, 1100.0], "steps/s").text() == "1234 steps/s (1100-1300)"
    with pytest.raises(ValueError, match="no values"):
        record.Summary.of("empty", [], "x")


def test_a_saved_result_holds_its_rows_machine_versions_and_command(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "alfworld_engine.py"), "--games", "2"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = [record.Summary.of("speed-up", [2.0, 3.0, 4.0], "x")]
    path = record.save_result("demo", "a demo benchmark", rows, [{"repeat": 0}], notes="n", results_dir=tmp_path)
    saved = json.loads(path.read_text())
    assert saved["command"] == "OMP_NUM_THREADS=1 python benchmarks/alfworld_engine.py --games 2"
    assert saved["summaries"] == [{"label": "speed-up", "median": 3.0, "low": 2.0, "high": 4.0, "repeats": 3,
                                   "unit": "x"}]
    assert saved["machine"]["cores"] >= 1 and saved["machine"]["OMP_NUM_THREADS"] == "1"
    assert {"python", "torch"} <= saved["versions"].keys()
    assert record.load_summaries(saved) == rows
    assert not list(tmp_path.glob("*.tmp"))  # written atomically

    line = table.row(saved)
    assert line.startswith("| a demo benchmark | `OMP_NUM_THREADS=1 python benchmarks/alfworld_engine.py --games 2` | "
                           "speed-up: **3.00x (2.00-4.00)** n |")
    assert f"{saved['machine']['cores']} cores" in line and "OMP_NUM_THREADS=1" in line


def test_the_published_page_is_what_the_saved_results_give():
    page = table.PAGE.read_text()
    assert table.render(page, table.table()) == page, "run python benchmarks/table.py"
    for path in record.RESULTS.glob("*.json"):
        assert table.row(json.loads(path.read_text())) in page
