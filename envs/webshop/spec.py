"""The WebShop EnvSpec: splits, prompt, action parsing and the expert."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
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
    observation_lines,
    select_tasks,
    select_template,
)
from envs.webshop.catalog import SPLITS, Catalog, Goal, check_files, load_catalog
from envs.webshop.env import (
    MAX_ACTION_CHARS,
    PRODUCT_WINDOW,
    SEARCH_RETURN_N,
    WebShopEnv,
    parse_webshop_action,
)
from envs.webshop.reward import check_options_match
from turnopd.core.data import resolve_data

ACTIONS = ("search", "click")
OPTIONS = {"reward_options_match": "webshop"}  # option -> default


def observation_without_goal(observation: str, task: str) -> str:
    """The page without its leading "Instruction: [SEP] <goal>" texts (the prompt states the goal),
    each text quoted, as verl-agent's WebShop prompt shows it."""
    texts = observation.split(" [SEP] ")
    if task in texts:
        texts = texts[texts.index(task) + 1 :]
    return " [SEP] ".join(f"'{t}'" for t in texts)


def render_default(ctx: PromptContext) -> str:
    """verl-agent's WebShop prompt (WEBSHOP_TEMPLATE, and _NO_HIS at the first step)."""
    actions = "\n".join(f"'{a}'," for a in ctx.admissible or [])
    observation = observation_without_goal(ctx.observation, ctx.task)
    history = [(observation_without_goal(obs, ctx.task), action) for obs, action in ctx.history]
    lines = [
        "You are an expert autonomous agent operating in the WebShop e-commerce environment.",
        f"Your task is to: {ctx.task}.",
        *observation_lines(history, ctx.step, f"{observation}."),
        f"Your admissible actions of the current situation are: \n[\n{actions}\n].",
        "",
        "Now it's your turn to take one action for the current step.",
        answer_instruction(ctx.answer_format),
    ]
    return "\n".join(lines)


TEMPLATES: dict[str, Callable[[PromptContext], str]] = {"default": render_default}


class WebShopExpert:
    """Searches the goal text, opens the target product (paging through the results, then
    searching its title if the goal text did not find it), clicks each goal option, buys."""

    def __init__(self, goal: Goal):
        self.goal = goal
        self.target = f"click[{goal.asin.lower()}]"
        self.queries = [goal.instruction_text, goal.name]  # searched in turn
        self.pages_seen = 0
        self.options_left: list[str] = []

    def act(self, outcome: StepOutcome) -> str:
        admissible = outcome.admissible or []
        if "click[buy now]" in admissible:  # the item page
            if self.options_left:
                return f"click[{self.options_left.pop(0)}]"
            return "click[buy now]"
        if self.target in admissible:
            self.options_left = list(self.goal.goal_options.values())
            return self.target
        if "click[next >]" in admissible and self.pages_seen < SEARCH_RETURN_N // PRODUCT_WINDOW - 1:
            self.pages_seen += 1
            return "click[next >]"
        # not found in these results: search again (from any page, as WebShop allows)
        self.pages_seen = 0
        query = self.queries.pop(0) if len(self.queries) > 1 else self.queries[0]
        return f"search[{query}]"


@lru_cache(maxsize=2)
def _engine_parts(root: Path) -> tuple[Catalog, Any, dict[str, list[str]]]:
    """The catalog, its BM25 index and its title nouns, loaded once per process and shared by its
    envs (all read-only)."""
    from envs.bm25 import BM25Index
    from envs.webshop.reward import cached_title_nouns

    catalog = load_catalog(root)
    index = BM25Index.cached("webshop-1k", catalog.contents)
    return catalog, index, cached_title_nouns([p["Title"] for p in catalog.products.values()])


class WebShopSpec:
    """WebShop-1k: the 1,000-product catalog with WebShop's synthetic goals (see catalog.py for
    the goals and the train/test split). Task types are the product categories (beauty,
    electronics, fashion, garden, grocery). Options: `reward_options_match`, how the reward matches
    goal options: "webshop" (default, exactly WebShop's get_reward) or "values" (see
    envs.webshop.reward)."""

    name = "webshop"
    default_max_turns = 15  # verl-agent's WebShop episode length
    # 2: goal options are matched as WebShop does; expert episodes cached before may be marked won wrongly
    observation_version = "2"

    def __init__(self, config: Any, data_dir: str | None = None):
        self.config = config
        self.root = resolve_data("webshop", data_dir)
        check_files(self.root)
        self.render_template = select_template(TEMPLATES, config.template, self.name)
        check_known("webshop options", config.options, OPTIONS, key="options")
        self.options_match = check_options_match(
            config.options.get("reward_options_match", OPTIONS["reward_options_match"]))

    def splits(self) -> list[str]:
        return list(SPLITS)

    def tasks(self, split: str) -> list[str]:
        check_split("WebShop", split, SPLITS)
        catalog = load_catalog(self.root)
        known = sorted({goal.category for goal in catalog.goals.values()})
        check_known("WebShop task types", self.config.task_types, known, key="task_types")
        return select_tasks(catalog.splits[split], self.task_type, self.config)

    def task_type(self, task_id: str) -> str:
        return load_catalog(self.root).goals[task_id].category

    def make(self) -> WebShopEnv:
        return WebShopEnv(*_engine_parts(self.root), options_match=self.options_match)

    def expert(self, task_id: str) -> Expert:
        return WebShopExpert(load_catalog(self.root).goals[task_id])

    def parse_action(self, text: str) -> ParsedAction:
        """The action in the answer; valid when it is `search[...]` or `click[...]` (WebShop's
        grammar); whether the click target exists is the env's call (info["invalid"])."""
        parsed = extract_action(text, max_chars=MAX_ACTION_CHARS)
        name, arg = parse_webshop_action(parsed.action)
        return ParsedAction(parsed.action, parsed.valid and name in ACTIONS and arg is not None)

    def render_prompt(self, ctx: PromptContext) -> str:
        return self.render_template(ctx)
