"""The ALFWorld EnvSpec: splits and task ids, prompt, action parsing and experts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envs.alfworld.experts import ExplorerExpert, HandcodedExpert, WalkthroughExpert
from envs.alfworld.game import GAME_FILE, AlfworldEnv
from envs.alfworld.notes import NOTES_PREFIX
from envs.base import (
    Expert,
    ParsedAction,
    PromptContext,
    answer_instruction,
    check_known,
    check_split,
    extract_action,
    observation_lines,
    select_tasks,
    select_template,
)
from turnopd.core.data import resolve_data

DATA_SUBDIR = "alfworld/json_2.1.1"
SPLITS = ("train", "valid_train", "valid_seen", "valid_unseen")
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
EXPERTS = ("walkthrough", "handcoded", "explorer")


def render_default(ctx: PromptContext) -> str:
    """verl-agent's ALFWorld prompt, admissible actions comma-separated ('help' left out, as there)."""
    actions = ", ".join(f"'{a}'" for a in ctx.admissible or [] if a != "help")
    lines = [
        f"You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {ctx.task}",
        *observation_lines(ctx.history, ctx.step, ctx.observation),
        f"Your admissible actions of the current situation are: [{actions}].",
        "",
        "Now it's your turn to take an action.",
        answer_instruction(ctx.answer_format),
    ]
    return "\n".join(lines)


def render_compact(ctx: PromptContext) -> str:
    """A short prompt for small models: the goal, the last actions, the observation (with the
    notebook line when the env option `notes` is on); no admissible-action list."""
    lines = [f"Your task is to: {ctx.task}"]
    if ctx.history:
        lines.append("Your last actions: " + "; ".join(action for _, action in ctx.history))
    lines += [f"Observation: {ctx.observation}", answer_instruction(ctx.answer_format)]
    return "\n".join(lines)


def render_notebook(ctx: PromptContext) -> str:
    """The shortest prompt, for tiny models: the goal, the last actions and the notebook line alone
    (the env option `notes`; it holds what the explorer expert acts on)."""
    notes = [line for line in ctx.observation.splitlines() if line.startswith(NOTES_PREFIX)]
    if not notes:
        raise ValueError("the alfworld template 'notebook' shows the notebook line: set the env option notes: true")
    lines = [f"Your task is to: {ctx.task}"]
    if ctx.history:
        lines.append("Your last actions: " + "; ".join(action for _, action in ctx.history))
    lines += [notes[-1], answer_instruction(ctx.answer_format)]
    return "\n".join(lines)


TEMPLATES: dict[str, Callable[[PromptContext], str]] = {
    "default": render_default, "compact": render_compact, "notebook": render_notebook}


class AlfworldSpec:
    """ALFWorld json_2.1.1 games on the TextWorld engine.

    Task ids are game folders relative to their split folder
    ('pick_and_place_simple-Book-None-Desk-308/trial_T20190908_...'), sorted. As ALFWorld's own
    loader, a split leaves out unsolvable games and the 'movable'/'Sliced' task folders.
    Options: `expert` (walkthrough | handcoded | explorer), `expert_seed` (the experts' random
    choices), `expert_noise` (explorer: share of turns that play a mistake, not imitated), `notes` (append the notebook line to each observation, see envs.alfworld.notes).
    Templates: `default` (verl-agent's prompt), `compact` (short), `notebook` (the goal and the
    notebook line only, for tiny models).
    """

    name = "alfworld"
    default_max_turns = 50
    observation_version = "2"  # 2: the notebook line (options.notes) searches destinations first

    def __init__(self, config: Any, data_dir: str | None = None):
        self.config = config
        self.root = resolve_data(DATA_SUBDIR, data_dir)
        self.render_template = select_template(TEMPLATES, config.template, self.name)
        check_known("ALFWorld task types", config.task_types, TASK_TYPES, key="task_types")
        check_known("alfworld options", config.options, ("expert", "expert_seed", "expert_noise", "notes"), key="options")
        self.expert_kind = config.options.get("expert", "walkthrough")
        if self.expert_kind not in EXPERTS:
            raise ValueError(f"unknown alfworld expert {self.expert_kind!r}; allowed: {', '.join(EXPERTS)}")
        self.notes = bool(config.options.get("notes", False))
        self._tasks: dict[str, list[str]] = {}

    def splits(self) -> list[str]:
        return list(SPLITS)

    def split_dir(self, split: str) -> Path:
        check_split("ALFWorld", split, SPLITS)
        return self.root / split

    def tasks(self, split: str) -> list[str]:
        if split not in self._tasks:
            self._tasks[split] = self._playable_games(split)
        return select_tasks(self._tasks[split], self.task_type, self.config)

    def _playable_games(self, split: str) -> list[str]:
        folder = self.split_dir(split)
        if not folder.is_dir():
            raise FileNotFoundError(f"ALFWorld split folder {folder} is missing (data root {self.root})")
        out = []
        for game in sorted(folder.glob(f"*/*/{GAME_FILE}")):
            task_id = game.parent.relative_to(folder).as_posix()
            if "movable" in task_id or "Sliced" in task_id or not _solvable(game):
                continue
            out.append(task_id)
        return out

    def task_type(self, task_id: str) -> str:
        return task_id.split("-", 1)[0]

    def make(self) -> AlfworldEnv:
        return AlfworldEnv([self.root / split for split in SPLITS], facts=self.expert_kind == "handcoded",
                           notes=self.notes)

    def expert(self, task_id: str) -> Expert:
        if self.expert_kind == "explorer":
            return ExplorerExpert(task_id, noise=float(self.config.options.get("expert_noise", 0.0)),
                                  seed=int(self.config.options.get("expert_seed", 0)))
        if self.expert_kind == "handcoded":
            return HandcodedExpert(task_id, seed=int(self.config.options.get("expert_seed", 0)))
        game = self.make().game_file(task_id)
        return WalkthroughExpert(json.loads(game.read_text())["walkthrough"])

    def parse_action(self, text: str) -> ParsedAction:
        parsed = extract_action(text)
        # ALFWorld's commands are lower case and the engine does not fold case
        return ParsedAction(action=parsed.action.lower(), valid=parsed.valid)

    def render_prompt(self, ctx: PromptContext) -> str:
        return self.render_template(ctx)


def _solvable(game: Path) -> bool:
    """ALFWorld marks games its planner could not solve; a file that is not JSON is left in, so
    that playing it reports the damage (the env raises GameLoadError)."""
    try:
        return bool(json.loads(game.read_text()).get("solvable", True))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True
