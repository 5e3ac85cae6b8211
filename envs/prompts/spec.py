"""The prompts EnvSpec: one JSONL file per split, one prompt per line, one turn per episode.

A line is {"prompt": "...", "id": "...", "type": "...", "answer": "..."}; only "prompt" is required.
The prompt is the user message, shown verbatim (the file carries its own instructions). The episode
ends at the student's first answer; with an "answer" the episode is won (reward 1) when the answer
given (inside <action>...</action> if the completion has one, else the whole completion) equals it,
case and spacing aside; without one the reward is 0 (pure distillation needs none). The expert
answers a line's "answer", so demonstrations (SFT) need every line to have one.

Options: `files`, {split: source}. A source is the path of a JSONL file (relative paths from the
working directory), or another env's first turns: {env: NAME, split: SPLIT, settings: {env block
keys}, expert_answers: BOOL, max_tasks: N}, rendered once into the cache (envs.cache: $TURNOPD_CACHE,
else ~/.cache/turnopd; what `turnopd env prompts` writes; expert_answers gives each prompt the env
expert's first action as its answer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from envs.base import (
    ENVS,
    EnvSpec,
    Expert,
    ParsedAction,
    PromptContext,
    StepOutcome,
    check_known,
    check_split,
    select_tasks,
)
from envs.cache import build_once, cache_root, content_key

OPTIONS: dict[str, Any] = {"files": {}}  # option -> default
DERIVED_KEYS = {"env", "split", "settings", "expert_answers", "max_tasks"}  # a source that renders another env's turns
DEFAULT_TYPE = "prompt"  # the task type of a line without "type"


@dataclass(frozen=True)
class PromptRow:
    task_id: str
    prompt: str
    task_type: str
    answer: str | None


def _normalized(text: str) -> str:
    return " ".join(text.split()).lower()


def given_answer(completion: str) -> str:
    """What a completion answers: the text of its last <action>...</action> (an unclosed tag too: the
    stop string cuts it), else the whole completion; stripped."""
    head, tag, tail = completion.rpartition("<action>")
    return (tail.split("</action>", 1)[0] if tag else completion).strip()


@lru_cache(maxsize=16)
def load_rows(path: Path, split: str, mtime_ns: int) -> tuple[PromptRow, ...]:
    """A split's rows (read once per file version). Ids default to '<split>/<line number>' (from 0)."""
    rows, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        where = f"{path}, line {number + 1}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise ValueError(f"{where}: a line must be an object with a non-empty string \"prompt\"")
        unknown = sorted(set(item) - {"prompt", "id", "type", "answer"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; allowed: prompt, id, type, answer")
        task_id = str(item.get("id", f"{split}/{number}"))
        if task_id in seen:
            raise ValueError(f"{where}: id {task_id!r} appears twice")
        seen.add(task_id)
        answer = item.get("answer")
        rows.append(PromptRow(task_id, item["prompt"], str(item.get("type", DEFAULT_TYPE)),
                              None if answer is None else str(answer)))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return tuple(rows)


def first_turn_rows(spec: EnvSpec, answer_format: str, split: str, n: int | None = None,
                    expert_answers: bool = False) -> Iterator[dict[str, str]]:
    """The first-turn prompt of each task of an env's split, as the student sees it, as prompts-file
    lines; with expert_answers, the env expert's first action as each one's answer."""
    env = spec.make()
    try:
        for task_id in spec.tasks(split)[:n]:
            outcome = env.reset(task_id)
            prompt = spec.render_prompt(PromptContext(
                task=outcome.info.get("task", ""), step=0, observation=outcome.observation, history=[],
                admissible=outcome.admissible, answer_format=answer_format))
            row = {"id": task_id, "type": spec.task_type(task_id), "prompt": prompt}
            if expert_answers:
                row["answer"] = spec.expert(task_id).act(outcome)
            yield row
    finally:
        env.close()


def write_rows(rows: Iterator[dict[str, str]], path: Path) -> int:
    """Write prompts-file lines atomically (a complete file or none); their count."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    count = 0
    with tmp.open("w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def derived_file(split: str, source: Mapping[str, Any], data_dir: str | None) -> Path:
    """The file of a derived source (another env's first turns), rendered on first use."""
    from turnopd.config import EnvConfig

    check_known(f"prompts option files.{split} keys", source, DERIVED_KEYS)
    if "env" not in source or "split" not in source:
        raise ValueError(f"prompts option files.{split}: a derived source needs `env` and `split`, e.g. "
                         "{env: alfworld, split: train, settings: {task_types: [look_at_obj_in_light]}}")
    config = EnvConfig(name=source["env"], **dict(source.get("settings") or {}))
    spec = ENVS.get(config.name)(config, data_dir)
    key = content_key(json.dumps({**source, "observation_version": spec.observation_version}, sort_keys=True,
                                 default=str))
    entry = build_once(cache_root() / "prompts" / f"{config.name}-{source['split']}-{key}", lambda folder: write_rows(
        first_turn_rows(spec, config.answer_format, source["split"], source.get("max_tasks"),
                        bool(source.get("expert_answers"))), folder / "prompts.jsonl"))
    return entry / "prompts.jsonl"


class PromptsEnv:
    """One prompt per episode; the first step ends it."""

    def __init__(self, rows: dict[str, PromptRow]):
        self.rows = rows
        self.row: PromptRow | None = None

    def reset(self, task_id: str) -> StepOutcome:
        self.row = self.rows[task_id]
        return StepOutcome(observation=self.row.prompt, info={"task": self.row.prompt})

    def step(self, action: str) -> StepOutcome:
        if self.row is None:
            raise RuntimeError("step before reset")
        won = self.row.answer is not None and _normalized(action) == _normalized(self.row.answer)
        self.row = None
        return StepOutcome(observation="", reward=float(won), done=True, won=won)

    def close(self) -> None:
        self.row = None


@dataclass
class AnswerExpert:
    """Answers the line's "answer"."""

    answer: str

    def act(self, outcome: StepOutcome) -> str:
        return self.answer


class PromptsSpec:
    """Prompts from JSONL files, one turn each (see the module docstring)."""

    name = "prompts"
    default_max_turns = 1
    observation_version = "1"

    def __init__(self, config: Any, data_dir: str | None = None):
        self.config = config
        check_known("prompts options", config.options, OPTIONS, key="options")
        files = config.options.get("files") or {}
        if not files:
            raise ValueError("the prompts env needs option `files`: {split: path of a JSONL file}, e.g. "
                             "env.options.files.train=prompts.jsonl")
        self.files = {split: derived_file(split, source, data_dir) if isinstance(source, Mapping)
                      else Path(str(source)).expanduser() for split, source in files.items()}
        for split, path in self.files.items():
            if not path.is_file():
                raise ValueError(f"prompts option files.{split}: {path} is not a file (write an env's first-turn "
                                 "prompts with `turnopd env prompts ENV --split SPLIT -o FILE`)")
        by_id: dict[str, PromptRow] = {}
        for split in self.files:
            for row in self._rows(split):
                if row.task_id in by_id:
                    raise ValueError(f"prompts: id {row.task_id!r} is in two splits; ids must be unique across "
                                     "splits (give lines an \"id\")")
                by_id[row.task_id] = row
        self.rows = by_id

    def _rows(self, split: str) -> tuple[PromptRow, ...]:
        path = self.files[split].resolve()
        return load_rows(path, split, path.stat().st_mtime_ns)

    def splits(self) -> list[str]:
        return list(self.files)

    def tasks(self, split: str) -> list[str]:
        check_split("prompts", split, self.splits())
        return select_tasks((row.task_id for row in self._rows(split)), self.task_type, self.config)

    def task_type(self, task_id: str) -> str:
        return self.rows[task_id].task_type

    def make(self) -> PromptsEnv:
        return PromptsEnv(self.rows)

    def expert(self, task_id: str) -> Expert:
        answer = self.rows[task_id].answer
        if answer is None:
            raise ValueError(f"prompts task {task_id!r} has no \"answer\" for the expert to give")
        return AnswerExpert(answer)

    def parse_action(self, text: str) -> ParsedAction:
        return ParsedAction(given_answer(text), True)  # free text is an answer

    def render_prompt(self, ctx: PromptContext) -> str:
        return ctx.observation
