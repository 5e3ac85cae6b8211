"""Multi-hop QA data: questions, the passage corpus and this project's train/test split.

Files (in the `multihop` data folder): `hotpotqa.json`, `2wiki.json`, `musique.json` (500
questions each: {id, Question, answer: [aliases], golden_context: ["Title\\n text", ...]}) and the
distractor corpora `corpus/hotpotqa_train_corpus.json` ({title: [sentences]}),
`corpus/musique_train_corpus.json` and `corpus/2wikimultihopqa_corpus.json` ([{title, text}]).

Corpus: every golden passage of the 1,500 questions, then every distractor passage, without
duplicates (same title and text). Split: each dataset's question ids are shuffled with
`random.Random(SPLIT_SEED)` (hotpotqa, then 2wiki, then musique, one generator); the first 100 are
test, the other 400 train. A split lists its questions round-robin over the datasets (hotpotqa,
2wiki, musique, hotpotqa, ...), so its first N tasks mix all three. A task id is "<dataset>/<id>".
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain, zip_longest
from pathlib import Path

DATASETS = {"hotpotqa": "hotpotqa.json", "2wiki": "2wiki.json", "musique": "musique.json"}
DISTRACTORS = ("corpus/hotpotqa_train_corpus.json", "corpus/musique_train_corpus.json",
               "corpus/2wikimultihopqa_corpus.json")
SPLIT_SEED = 0
TEST_PER_DATASET = 100
SPLITS = ("train", "test")


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    task_id: str
    dataset: str
    question: str
    answers: tuple[str, ...]  # accepted answers (aliases), the first is the main one
    golden: tuple[Passage, ...]  # supporting passages, in the dataset's order


@dataclass
class MultihopData:
    questions: dict[str, Question]
    passages: list[Passage]  # the corpus; a passage's position is its index ordinal
    splits: dict[str, list[str]]


def check_files(folder: Path) -> None:
    """Fail with the missing file's path when the data folder is incomplete."""
    for name in (*DATASETS.values(), *DISTRACTORS):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"multi-hop data file {folder / name} is missing (data folder {folder})")


def parse_golden(passage: str) -> Passage:
    """A golden passage "Title\\n text" -> Passage."""
    title, _, text = passage.partition("\n")
    return Passage(title.strip(), text.strip())


def load_questions(folder: Path, dataset: str) -> list[Question]:
    rows = json.loads((folder / DATASETS[dataset]).read_text())
    return [
        Question(
            task_id=f"{dataset}/{row['id']}",
            dataset=dataset,
            question=row["Question"],
            answers=tuple(row["answer"]),
            golden=tuple(parse_golden(p) for p in row["golden_context"]),
        )
        for row in rows
    ]


def load_distractors(folder: Path) -> list[Passage]:
    hotpot, musique, wiki = (json.loads((folder / name).read_text()) for name in DISTRACTORS)
    out = [Passage(title.strip(), "".join(sentences).strip()) for title, sentences in hotpot.items()]
    out += [Passage(row["title"].strip(), row["text"].strip()) for row in chain(musique, wiki)]
    return out


@lru_cache(maxsize=4)
def load_multihop(folder: Path) -> MultihopData:
    """Questions, corpus and splits of the multi-hop data in `folder` (cached per process)."""
    check_files(folder)
    by_dataset = {name: load_questions(folder, name) for name in DATASETS}
    questions = {q.task_id: q for qs in by_dataset.values() for q in qs}
    golden = [p for q in questions.values() for p in q.golden]
    passages = list(dict.fromkeys(golden + load_distractors(folder)))  # dedupe, keep order
    rng = random.Random(SPLIT_SEED)
    test, train = [], []
    for qs in by_dataset.values():
        ids = [q.task_id for q in qs]
        rng.shuffle(ids)
        test.append(ids[:TEST_PER_DATASET])
        train.append(ids[TEST_PER_DATASET:])
    return MultihopData(questions, passages, {"train": _round_robin(train), "test": _round_robin(test)})


def _round_robin(lists: list[list[str]]) -> list[str]:
    return [x for group in zip_longest(*lists) for x in group if x is not None]
