"""The embedded BM25 index and the build-once cache the search envs rely on."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from envs.bm25 import BM25Index
from envs.cache import build_once

DOCS = ["red running shoes for women", "blue running shorts", "a garden hose, 50 feet", "shoes shoes shoes"]


@pytest.fixture()
def index(tmp_path: Path) -> BM25Index:
    folder = tmp_path / "idx"
    folder.mkdir()
    BM25Index.build(folder, DOCS)
    return BM25Index(folder)


def test_search_ranks_by_bm25_and_stems(index):
    assert index.terms("The Running Shoes!") == ["run", "shoe"]  # stop word dropped, stemmed
    # 'shoe' occurs 3 times in the 3-word doc 3, once in the 5-word doc 0; 'running' only in 0 and 1
    assert index.search("shoe", 10) == [3, 0]
    # BM25 (k1 1.2, b 0.75), idf(run) = idf(shoe) = ln(1 + 2.5/2.5) = 0.693, doc lengths 4 3 4 3
    # (avg 3.5): doc 0 = 2 * 0.693 * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 4/3.5)) = 1.31 beats
    # doc 3 = 0.693 * 3 * 2.2 / (3 + 1.2 * (0.25 + 0.75 * 3/3.5)) = 1.12
    assert index.search("running shoes", 10)[0] == 0
    assert set(index.search("running shoes", 10)) == {0, 1, 3}
    assert index.search("running shoes", 1) == [0]


def test_queries_without_terms_or_with_garbage_find_nothing(index):
    assert index.search("the a of", 5) == []
    assert index.search("\udcff💥 ☃", 5) == []
    assert index.search("hose", 0) == []
    assert index.search("AND OR NOT \"( title:", 5) == []  # no query syntax: plain words


def test_cached_index_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNOPD_CACHE", str(tmp_path))
    first = BM25Index.cached("tiny", DOCS)
    second = BM25Index.cached("tiny", DOCS)
    assert first.search("hose", 3) == second.search("hose", 3) == [2]
    assert len(list((tmp_path / "bm25").iterdir())) == 1
    BM25Index.cached("tiny", [*DOCS, "another"])  # other content, other folder
    assert len(list((tmp_path / "bm25").iterdir())) == 2


def _slow_build(target: str) -> None:
    def build(folder: Path) -> None:
        (folder / "builder").write_text(str(os.getpid()))
        time.sleep(0.3)

    build_once(Path(target), build)


def test_build_once_is_safe_when_two_processes_race(tmp_path):
    target = tmp_path / "entry"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_slow_build, args=(str(target),)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    assert [w.exitcode for w in workers] == [0, 0]
    assert int((target / "builder").read_text()) in {w.pid for w in workers}
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no scratch folder left


def test_build_once_failure_leaves_nothing(tmp_path):
    def broken(folder: Path) -> None:
        (folder / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(tmp_path / "entry", broken)
    assert list(tmp_path.iterdir()) == []
