"""The multi-hop search EnvSpec: splits, prompt, action parsing and the expert."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from envs.base import (
    Expert,
    ParsedAction,
    PromptContext,
    StepOutcome,
    answer_instruction,
    check_known,
    check_split,
    extract_action,
    history_sentence,
    select_tasks,
    select_template,
)
from envs.search.data import DATASETS, SPLITS, MultihopData, Question, check_files, load_multihop
from envs.search.env import MAX_ACTION_CHARS, SearchEnv, check_f1_rule, parse_search_action
from turnopd.core.data import resolve_data

OPTIONS = {"top_k": 3, "f1_rule": "official", "passage_chars": None}  # option -> default


def render_default(ctx: PromptContext, top_k: int, max_turns: int) -> str:
    """verl-agent's search prompt in this project's action grammar: the question, the history of
    searches and results, the current result, the two actions and the answer format."""
    lines = [
        "You are an expert agent tasked with answering the given question step-by-step.",
        f"Your question: {ctx.task}",
    ]
    if ctx.history:
        lines.append(history_sentence(ctx.history, ctx.step))
    if ctx.step > 0:
        lines.append(f"You are now at step {ctx.step + 1} and your current observation is: {ctx.observation}")
    lines += [
        f"You have {max_turns - ctx.step} step(s) left, this one included. Your available actions are:",
        f"search[<your query>]: search the knowledge base; it returns the top {top_k} passages.",
        "answer[<your answer>]: give your final answer, a short phrase without explanation "
        "(for example, answer[Beijing]); this ends the episode.",
        "",
        "Now it's your turn to take one action for the current step.",
        answer_instruction(ctx.answer_format),
    ]
    return "\n".join(lines)


def render_compact(ctx: PromptContext, top_k: int, max_turns: int) -> str:
    """The default's content in a third of its words, for a model of a few hundred positions: the
    question, the history and the current result, the two actions, the answer format."""
    lines = [f"Question: {ctx.task}"]
    if ctx.history:
        lines.append(history_sentence(ctx.history, ctx.step))
    if ctx.step > 0:
        lines.append(f"Result: {ctx.observation}")
    lines += [f"Step {ctx.step + 1} of {max_turns}. Actions: search[<query>] (top {top_k} passages) or "
              "answer[<short answer>] (ends the episode).", answer_instruction(ctx.answer_format)]
    return "\n".join(lines)


TEMPLATES: dict[str, Callable[..., str]] = {"default": render_default, "compact": render_compact}


@dataclass
class SearchExpert:
    """Searches the titles of the golden passages in turn (as many as the turns allow, keeping one
    turn for the answer), then answers the first accepted answer."""

    question: Question
    max_turns: int
    queries: list[str] = field(init=False)

    def __post_init__(self) -> None:
        titles = list(dict.fromkeys(p.title for p in self.question.golden))
        self.queries = titles[: max(self.max_turns - 1, 0)]

    def act(self, outcome: StepOutcome) -> str:
        if self.queries:
            return f"search[{self.queries.pop(0)}]"
        return f"answer[{self.question.answers[0]}]"


@lru_cache(maxsize=2)
def _engine_parts(root: Path) -> tuple[MultihopData, Any]:
    """The data and its BM25 index (a passage is searched as "title\\ntext"), loaded once per
    process and shared by its envs (both read-only)."""
    from envs.bm25 import BM25Index

    data = load_multihop(root)
    return data, BM25Index.cached("multihop", [f"{p.title}\n{p.text}" for p in data.passages])


class SearchSpec:
    """Multi-hop QA by search over HotpotQA, 2WikiMultihopQA and MuSiQue (500 questions each; see
    data.py for the corpus and the split). Task types are the dataset names. Options: `top_k`
    (passages per search, default 3) and `f1_rule`, the rule of info["score"]: "official" (default,
    each dataset's official evaluation) or "squad" (see envs.search.metrics); `passage_chars` (default
    None: whole) cuts each passage's text to its first N characters, so that a small model's context
    holds a search's result (a 512-position model with a byte-level BPE trained on ALFWorld text)."""

    name = "search"
    default_max_turns = 4
    observation_version = "1"

    def __init__(self, config: Any, data_dir: str | None = None):
        self.config = config
        self.root = resolve_data("multihop", data_dir)
        check_files(self.root)
        check_known("search options", config.options, OPTIONS, key="options")
        self.top_k = config.options.get("top_k", OPTIONS["top_k"])
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"search option top_k must be a positive integer; got {self.top_k!r}")
        self.f1_rule = check_f1_rule(config.options.get("f1_rule", OPTIONS["f1_rule"]))
        self.passage_chars = config.options.get("passage_chars", OPTIONS["passage_chars"])
        if self.passage_chars is not None and (not isinstance(self.passage_chars, int) or self.passage_chars < 1):
            raise ValueError(f"search option passage_chars must be a positive integer or null; got {self.passage_chars!r}")
        check_known("search task types", config.task_types, DATASETS, key="task_types")
        template = select_template(TEMPLATES, config.template, self.name)
        self.render_template = partial(template, top_k=self.top_k, max_turns=config.max_turns)

    def splits(self) -> list[str]:
        return list(SPLITS)

    def tasks(self, split: str) -> list[str]:
        check_split("search", split, SPLITS)
        return select_tasks(load_multihop(self.root).splits[split], self.task_type, self.config)

    def task_type(self, task_id: str) -> str:
        return task_id.split("/", 1)[0]

    def make(self) -> SearchEnv:
        return SearchEnv(*_engine_parts(self.root), self.top_k, self.f1_rule, self.passage_chars)

    def expert(self, task_id: str) -> Expert:
        return SearchExpert(load_multihop(self.root).questions[task_id], self.config.max_turns)

    def parse_action(self, text: str) -> ParsedAction:
        """The action in the answer; valid when it is search[...] or answer[...] with an argument."""
        parsed = extract_action(text, max_chars=MAX_ACTION_CHARS)
        return ParsedAction(parsed.action, parsed.valid and parse_search_action(parsed.action) is not None)

    def render_prompt(self, ctx: PromptContext) -> str:
        return self.render_template(ctx)
