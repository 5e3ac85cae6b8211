"""The environment interface: an `Env` plays one episode at a time inside an env-pool worker; an
`EnvSpec` (registered by name, picklable, lives in the main process) knows the env's splits, task
types, prompt template, action parser and expert, and makes `Env`s.
"""

from __future__ import annotations

import abc
import dataclasses
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from turnopd.core.registry import Registry

T = TypeVar("T")


@dataclass
class StepOutcome:
    """What the env returns from reset (reward 0, done False) and from each step.

    info may hold: "task" (the goal text, set by reset), "invalid" (the env did not accept the
    action), "env_error" (set by the pool when a worker crashed or hung).
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    won: bool = False
    admissible: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    def reset(self, task_id: str) -> StepOutcome: ...
    def step(self, action: str) -> StepOutcome: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ParsedAction:
    """A model answer turned into an env action. `valid` is False when the answer did not follow
    the format; `action` is then what the env receives (the env treats it as it would any
    unrecognized command)."""

    action: str
    valid: bool


class Expert(Protocol):
    """An expert policy for one episode: the env action to take after `outcome`. An expert that
    explores (plays a deliberate mistake, to show recovery) sets `exploring = True` for that turn;
    demonstrations play such turns but do not train on them."""

    def act(self, outcome: StepOutcome) -> str: ...


@runtime_checkable
class RelabellingExpert(Expert, Protocol):
    """An expert that can act from states another player reached (DAgger relabelling): `label` is
    its own choice after `outcome` (no exploring mistakes), `follow` tells it which command was
    played instead, so that what it tracks of the episode stays true. An expert that replays a fixed
    plan cannot do this and does not implement it."""

    def label(self, outcome: StepOutcome) -> str: ...

    def follow(self, command: str) -> None: ...


@dataclass(frozen=True)
class MetricReading:
    """What an observation reports of one scored change, in an env whose steps are experiments
    (autoresearch): the metric as the observation writes it (autoresearch: accuracy in percent) and
    whether the change helped (the env kept it)."""

    metric: float
    helps: bool
    change: float | None = None  # the metric's change against the best before it, as written (None: not written)


class WorldAnswerer(abc.ABC):
    """A world model that computes its answers instead of generating them, shipped by its env
    (`EnvSpec.world_answerer(folder)` for a world_model.json of kind "answerer"; autoresearch's job
    model: the env itself with each job's accuracy predicted, envs.autoresearch.job_model). The
    world-model pool (turnopd.rollout.world_model_pool) asks it as it samples a language model."""

    @abc.abstractmethod
    def answers(self, prompt: str, seeds: Sequence[int], temperature: float) -> list[str]:
        """One answer ("status\nobservation") to a world prompt (envs.transitions.world_prompt) per
        sampling seed; temperature 0: its best guess."""


@runtime_checkable
class MetricReader(Protocol):
    """An EnvSpec whose step observations report a metric: `read_metric` reads it back (None for an
    observation that reports none: an invalid action, a submit). A world model of such an env is also
    graded on the metric it predicts (turnopd.orchestration.world_model_training)."""

    def read_metric(self, observation: str) -> MetricReading | None: ...


@dataclass
class PromptContext:
    """Everything a prompt template may show at one turn."""

    task: str  # the goal
    step: int  # steps already taken (0 at the first turn)
    observation: str  # current observation
    history: list[tuple[str, str]]  # the last `history_length` (observation, action) pairs, oldest first
    admissible: list[str] | None = None
    answer_format: str = "think_action"


IMAGE_PLACEHOLDER = "<image>"  # where a screenshot goes in a prompt's text (a VLM's image token)
HIDDEN_PAGE = "(page not shown)"  # a page older than the screenshot window


def shows_screenshots(spec: Any) -> bool:
    """Whether an EnvSpec (or its class) shows its pages as screenshots (EnvSpec.shows_screenshots;
    a spec is an EnvSpec by its shape, not by subclassing it, so one that does not set the
    capability reads as the protocol's default)."""
    return getattr(spec, "shows_screenshots", EnvSpec.shows_screenshots)


def screenshot_view(ctx: PromptContext, keys: Sequence[str], window: int) -> tuple[PromptContext, list[str]]:
    """The student's view of a turn in an env that shows screenshots: the current page and the
    pages of the last `window` - 1 turns of ctx.history as IMAGE_PLACEHOLDER, older pages of the
    history as HIDDEN_PAGE (their actions stay), and the screenshot keys in the order a template
    that shows the history before the current page writes the placeholders. `keys`: the keys of
    ctx.history's pages and then the current page's (len(ctx.history) + 1)."""
    if len(keys) != len(ctx.history) + 1:
        raise ValueError(f"screenshot_view needs a key per history page and the current page: {len(keys)} keys "
                         f"for {len(ctx.history)} history pairs")
    shown = min(window - 1, len(ctx.history))
    first_shown = len(ctx.history) - shown
    history = [(IMAGE_PLACEHOLDER if i >= first_shown else HIDDEN_PAGE, action)
               for i, (_, action) in enumerate(ctx.history)]
    return (dataclasses.replace(ctx, observation=IMAGE_PLACEHOLDER, history=history),
            list(keys[first_shown:]))


class EnvSpec(Protocol):
    name: str
    default_max_turns: int
    # Bump when the observation text changes (e.g. a new notebook line): expert demonstrations cached
    # with the old text are then played again instead of silently trained on (turnopd.orchestration.sft).
    observation_version: str
    # Capability: its pages are shown to the student as screenshots (read by envs.base.shows_screenshots).
    # Such a spec also has `screenshot_window` (the pages a prompt shows as images), `pixel_store`
    # (turnopd.core.pixels) and `put_screenshot(observation, admissible)` (envs/webshop/screenshot.py).
    # A spec whose observations report a metric implements MetricReader (`read_metric`).
    shows_screenshots: ClassVar[bool] = False
    # Capability: the system prompt of a chat episode (prompt.style=chat, docs/chat.md) when the recipe's
    # prompt.system does not set one; "" for none.
    system_prompt: ClassVar[str] = ""

    def splits(self) -> list[str]: ...
    def tasks(self, split: str) -> list[str]: ...  # deterministic order
    def task_type(self, task_id: str) -> str: ...
    def make(self) -> Env: ...  # called inside a worker process
    def expert(self, task_id: str) -> Expert: ...
    def parse_action(self, text: str) -> ParsedAction: ...
    def render_prompt(self, ctx: PromptContext) -> str: ...  # the user message of one turn


# name -> EnvSpec class, constructed as ENVS.get(name)(env_config, data_dir); each env package registers its own
ENVS: Registry[Callable[..., EnvSpec]] = Registry("env")


# ---- answer formats shared by all envs ------------------------------------------------------

ANSWER_FORMATS = ("think_action", "action")

ANSWER_INSTRUCTIONS = {
    "think_action": (
        "You should first reason step-by-step about the current situation. This reasoning process "
        "MUST be enclosed within <think> </think> tags. Once you've finished your reasoning, you "
        "should choose an action for the current step and present it within <action> </action> tags."
    ),
    "action": "Present your action for the current step within <action> </action> tags.",
}

_ACTION_RE = re.compile(r"<action>(.*?)</action>", re.DOTALL)
_OPEN_ACTION_RE = re.compile(r"<action>(.*)\Z", re.DOTALL)


def answer_instruction(answer_format: str) -> str:
    """The sentence that tells the model how to lay out its answer."""
    if answer_format not in ANSWER_INSTRUCTIONS:
        raise ValueError(f"unknown answer_format {answer_format!r}; allowed: {', '.join(ANSWER_FORMATS)}")
    return ANSWER_INSTRUCTIONS[answer_format]


def recent_pairs(history: Sequence[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    """The last n (observation, action) pairs of an episode's history, oldest first (none for n = 0,
    which a plain history[-n:] would not give)."""
    return list(history[-n:]) if n else []


def format_history(history: list[tuple[str, str]], step: int) -> str:
    """verl-agent's history block: one `[Observation k: '...', Action k: '...']` line per pair, k being
    the step (1-based) at which the action was taken; `step` is the number of steps taken so far."""
    first = step - len(history) + 1
    return "\n".join(
        f"[Observation {first + i}: '{obs}', Action {first + i}: '{action}']"
        for i, (obs, action) in enumerate(history)
    )


def history_sentence(history: list[tuple[str, str]], step: int) -> str:
    """verl-agent's sentence that shows the recent (observation, action) pairs after `step` steps."""
    return (f"Prior to this step, you have already taken {step} step(s). Below are the most recent "
            f"{len(history)} observations and the corresponding actions you took: {format_history(history, step)}")


def observation_lines(history: list[tuple[str, str]], step: int, observation: str) -> list[str]:
    """verl-agent's lines for the current turn: the current observation, preceded by the recent history
    (and the step number) once there is one."""
    if not history:
        return [f"Your current observation is: {observation}"]
    return [history_sentence(history, step),
            f"You are now at step {step + 1} and your current observation is: {observation}"]


class EnvSettingError(ValueError):
    """A value of a recipe's env block that the env refuses; `key` is its key in the block (e.g.
    "task_types"), which the recipe check names."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def check_known(what: str, given: Iterable[str], allowed: Collection[str], key: str | None = None) -> None:
    """A recipe's names (task types, options) checked against what an env knows: the error names the
    unknown ones and lists the allowed ones (an EnvSettingError when `key`, the env block's key, is given)."""
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        message = f"unknown {what} {unknown}; allowed: {', '.join(allowed)}"
        raise EnvSettingError(message, key) if key else ValueError(message)


def check_split(env: str, split: str, splits: Sequence[str]) -> None:
    if split not in splits:
        raise ValueError(f"unknown {env} split {split!r}; allowed: {', '.join(splits)}")


def split_tasks(spec: EnvSpec, splits: str) -> list[str]:
    """The tasks of `splits`: one split name, or several joined by '+' (e.g. 'valid_unseen+valid_seen'),
    their tasks in that order. Task ids are unique across an env's splits, so any worker plays any."""
    names = [name.strip() for name in splits.split("+")]
    for name in names:
        if name not in spec.splits():
            raise ValueError(f"unknown {spec.name} split {name!r} in {splits!r}; allowed: {', '.join(spec.splits())} "
                             "(or several joined by '+')")
    if len(set(names)) < len(names):
        raise ValueError(f"split {splits!r} names a split twice")
    return [task for name in names for task in spec.tasks(name)]


def select_tasks(tasks: Iterable[str], task_type: Callable[[str], str], config: Any) -> list[str]:
    """A split's tasks (in their order) of the env config's `task_types` (all when empty), cut to its
    `max_tasks` (None: all)."""
    wanted = set(config.task_types)
    return [t for t in tasks if not wanted or task_type(t) in wanted][: config.max_tasks]


def select_template(templates: dict[str, T], name: str, env: str) -> T:
    """The prompt template `name` of an env, or a clear error listing the env's templates."""
    if name not in templates:
        raise ValueError(f"unknown prompt template {name!r} for env {env!r}; allowed: {', '.join(templates)}")
    return templates[name]


def format_answer(action: str, answer_format: str = "think_action", thought: str = "") -> str:
    """How a model's answer that takes `action` looks (expert demonstrations use this)."""
    if answer_format == "think_action":
        return f"<think>{thought}</think><action>{action}</action>"
    if answer_format == "action":
        return f"<action>{action}</action>"
    raise ValueError(f"unknown answer_format {answer_format!r}; allowed: {', '.join(ANSWER_FORMATS)}")


def extract_action(text: str, max_chars: int = 500) -> ParsedAction:
    """The action inside the last <action>...</action> of a model answer.

    A missing closing tag is accepted (generation often stops at the stop string "</action>",
    which is then not part of the text). No tag at all, an empty action or one longer than
    `max_chars` is invalid; the stripped raw text (cut to max_chars) is passed on instead.
    """
    found = _ACTION_RE.findall(text)
    if not found:
        open_tag = _OPEN_ACTION_RE.search(text)
        found = [open_tag.group(1)] if open_tag else []
    if found:
        action = " ".join(found[-1].split())
        if action and len(action) <= max_chars:
            return ParsedAction(action=action, valid=True)
    return ParsedAction(action=" ".join(text.split())[:max_chars], valid=False)
