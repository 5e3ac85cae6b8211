"""Multi-hop search: answer a question by searching a passage corpus (Search-R1's task, as an env).

Actions: `search[query]` returns the top-k passages by BM25, formatted as Search-R1 shows them
("Doc 1(Title: <title>) <text>", one per line); `answer[text]` ends the episode with reward =
exact match (SQuAD normalization) against the accepted answers, and info["score"] = token F1, by
default under the official rule of the question's dataset (HotpotQA's for hotpotqa and 2wiki: a
'yes'/'no'/'noanswer' on either side scores 0 unless both agree; MuSiQue's for musique), or
SQuAD's with f1_rule="squad" (see envs.search.metrics).
Anything else (another command, an empty argument, an action longer than MAX_ACTION_CHARS, any
action after the answer) is invalid: the env says so and nothing else changes.
"""

from __future__ import annotations

import re

from envs.base import StepOutcome
from envs.bm25 import BM25Index
from envs.search.data import MultihopData, Question
from envs.search.metrics import OFFICIAL_F1, exact_match, f1_score

MAX_ACTION_CHARS = 500
ACTION_RE = re.compile(r"(search|answer)\[(.*)\]", re.DOTALL)
INVALID_MESSAGE = (
    "Your previous action is invalid. To search, write search[your query]; to give your final answer, "
    "write answer[your answer]."
)
NO_RESULTS = "No passage matches this query."
F1_OPTIONS = ("official", "squad")  # the env's f1_rule: each dataset's official rule, or SQuAD's


def check_f1_rule(f1_rule: object) -> str:
    """`f1_rule` if it is one of F1_OPTIONS, else a ValueError naming the option and its values."""
    if f1_rule not in F1_OPTIONS:
        raise ValueError(f"search option f1_rule must be one of {', '.join(F1_OPTIONS)}; got {f1_rule!r}")
    return f1_rule


def parse_search_action(action: str) -> tuple[str, str] | None:
    """`search[q]` / `answer[a]` -> (name, stripped argument); None when not of that form or empty."""
    match = ACTION_RE.fullmatch(action.strip()) if len(action) <= MAX_ACTION_CHARS else None
    if match is None or not match.group(2).strip():
        return None
    return match.group(1), match.group(2).strip()


def format_passages(passages: list[tuple[str, str]]) -> str:
    """Search-R1's _passages2string: "Doc i(Title: t) text" lines."""
    return "\n".join(f"Doc {i}(Title: {title}) {text}" for i, (title, text) in enumerate(passages, 1))


class SearchEnv:
    """One question at a time over the multi-hop corpus and its BM25 index; `f1_rule` is "official"
    (each question's dataset's rule) or "squad"."""

    def __init__(self, data: MultihopData, index: BM25Index, top_k: int, f1_rule: str = "official",
                 passage_chars: int | None = None):
        self.data = data
        self.index = index
        self.top_k = top_k
        self.passage_chars = passage_chars  # each passage's text cut to its first N characters (None: whole)
        self.f1_rule = check_f1_rule(f1_rule)
        self.question: Question | None = None
        self.done = False

    def reset(self, task_id: str) -> StepOutcome:
        if task_id not in self.data.questions:
            raise KeyError(f"unknown search task id {task_id!r} (ids are '<dataset>/<id>', see spec.tasks())")
        self.question = self.data.questions[task_id]
        self.done = False
        return StepOutcome(observation=f"Question: {self.question.question}", info={"task": self.question.question})

    def step(self, action: str) -> StepOutcome:
        if self.question is None:
            raise RuntimeError("SearchEnv.step called before reset")
        parsed = None if self.done else parse_search_action(action)
        if parsed is None:
            return StepOutcome(observation=INVALID_MESSAGE, done=self.done, info={"invalid": True})
        name, argument = parsed
        if name == "search":
            hits = [self.data.passages[i] for i in self.index.search(argument, self.top_k)]
            observation = format_passages([(p.title, p.text[: self.passage_chars]) for p in hits]) if hits else NO_RESULTS
            return StepOutcome(observation=observation, info={"invalid": False, "titles": [p.title for p in hits]})
        self.done = True
        em = exact_match(argument, self.question.answers)
        rule = OFFICIAL_F1[self.question.dataset] if self.f1_rule == "official" else "squad"
        f1 = f1_score(argument, self.question.answers, rule)
        return StepOutcome(
            observation=f"Your answer: {argument} (exact match {em:.0f}, F1 {f1:.2f}).",
            reward=em,
            done=True,
            won=em == 1.0,
            info={"invalid": False, "score": f1, "em": em, "f1": f1},
        )

    def close(self) -> None:
        self.question = None
