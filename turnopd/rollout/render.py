"""What the policy is shown each turn: a Renderer turns the turn's PromptContext (and the info of its
observations) into the token ids the policy reads.

`TextView` (every env): the env's template (task, step, current observation, the last
`env.history_length` (observation, action) pairs, admissible actions) as ONE user message wrapped in
the policy tokenizer's chat template, rendered afresh each turn (verl-agent style).
`ScreenshotView` (an env that shows screenshots, envs.base.shows_screenshots, and a vision-language
policy): the same template with an image in place of each page the window shows, and the pages'
text for a text teacher. `ReadScreenView` (such an env and a text student with a screen reader): the
same with the text the reader reads off each page's screenshot in its place.
`ChatView` (prompt.style=chat): the episode as one conversation that only grows (token in, token out:
the ids the policy sampled stay in every later prompt), turnopd.rollout.chat and docs/chat.md.
`TeacherTokens` (objective.tokenizers=cross) wraps any of them for a teacher of another tokenizer:
each turn also rendered by the same view over the teacher's tokenizer, and each action's text in the
teacher's tokens, aligned with the student's (`finish_turn`).
`renderer_for` picks one. A renderer also reads the policy's answer back into an env action
(`parse_action`): the env's own parser, or a tool call's argument.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from envs.base import (
    IMAGE_PLACEHOLDER,
    EnvSpec,
    ParsedAction,
    PromptContext,
    answer_instruction,
    format_answer,
    screenshot_view,
    shows_screenshots,
)
from turnopd.algorithm.token_alignment import cross_tokens
from turnopd.config import PromptConfig, RecipeError
from turnopd.core.text import expand_placeholders
from turnopd.core.types import Turn
from turnopd.rollout.chat import (
    ACT_TOOL,
    TOOL_INSTRUCTION,
    answer_closing,
    appended_text,
    parse_tool_call,
    require_tools,
    tool_call_text,
)


@dataclass(frozen=True)
class PriorStep:
    """A step played before the policy's first turn (a takeover's replay, turnopd.rollout.takeover):
    the state it was played from and the action."""

    observation: str
    admissible: list[str] | None
    action: str
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RenderedPrompt:
    """A turn's prompt: the ids the policy reads, the pixel-store keys of the images in them (in
    placeholder order), and the ids a teacher reads instead (None: `ids`)."""

    ids: list[int]
    image_keys: list[str] = field(default_factory=list)
    teacher_ids: list[int] | None = None


class Renderer(Protocol):
    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]], turns: Sequence[Turn],
               prior: Sequence[PriorStep] = ()) -> RenderedPrompt | None:
        """The prompt of a turn, or None when it would not fit the renderer's context (the episode
        then ends, truncated). `infos`: the env's info of each observation in ctx.history, then the
        current observation's; `turns`: the episode's turns so far, as played; `prior`: the steps
        played before its first turn (ctx.history holds the last of them, as a window)."""
        ...

    def parse_action(self, text: str) -> ParsedAction:
        """The env action of the policy's answer `text`."""
        ...

    def format_answer(self, action: str, answer_format: str) -> str:
        """How an answer that takes `action` reads (an expert's, in demonstrations)."""
        ...

    def finish_turn(self, turn: Turn) -> Turn:
        """The turn as played, with what the renderer adds once its action is known."""
        ...


class EnvAnswers:
    """Answers as the env writes and reads them: its answer format and its own parser."""

    spec: EnvSpec

    def parse_action(self, text: str) -> ParsedAction:
        return self.spec.parse_action(text)

    def format_answer(self, action: str, answer_format: str) -> str:
        return format_answer(action, answer_format)

    def finish_turn(self, turn: Turn) -> Turn:
        return turn


def chat_prompt_ids(tokenizer: Any, user_message: str) -> list[int]:
    """The token ids of one user message in the tokenizer's chat template, ready for the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the policy tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; "
                         "the rollout engine sends each prompt as a chat user message")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


@dataclass(frozen=True)
class TextView(EnvAnswers):
    spec: EnvSpec
    tokenizer: Any

    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]], turns: Sequence[Turn],
               prior: Sequence[PriorStep] = ()) -> RenderedPrompt:
        return RenderedPrompt(chat_prompt_ids(self.tokenizer, self.spec.render_prompt(ctx)))


@dataclass(frozen=True)
class ScreenshotView(EnvAnswers):
    """A vision-language policy's view of an env that shows screenshots (`image_tokens` positions an
    image): an image in place of each page the window shows (envs.base.screenshot_view), and the
    pages' text as the prompt a text teacher reads instead. `infos`' "screenshot": the pixel-store keys
    of ctx.history's pages, then the current page's."""

    spec: EnvSpec
    tokenizer: Any
    image_tokens: int

    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]], turns: Sequence[Turn],
               prior: Sequence[PriorStep] = ()) -> RenderedPrompt:
        text = chat_prompt_ids(self.tokenizer, self.spec.render_prompt(ctx))
        view, keys = screenshot_view(ctx, [info.get("screenshot", "") for info in infos], self.spec.screenshot_window)
        placeholder = self.tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
        ids = chat_prompt_ids(self.tokenizer, self.spec.render_prompt(view))
        if ids.count(placeholder) != len(keys):
            raise ValueError(f"the policy's tokenizer ({getattr(self.tokenizer, 'name_or_path', '?')}) does not keep "
                             f"{IMAGE_PLACEHOLDER} as one token: {ids.count(placeholder)} in a prompt of {len(keys)} "
                             "images")
        return RenderedPrompt(expand_placeholders(ids, placeholder, self.image_tokens), keys, text)


class ScreenReading(Protocol):
    """Reads screenshots into text (turnopd.models.screen_reader.ScreenReader)."""

    def read(self, screens: Sequence[Any]) -> list[str]: ...


@dataclass(frozen=True)
class ReadScreenView(EnvAnswers):
    """A text policy's view of an env that shows screenshots through a screen reader (student.screen_reader,
    docs/screenshots.md): the env's template with each page the window shows (envs.base.screenshot_view)
    replaced by the text the reader reads off its screenshot (fetched from the env's pixel store), older
    pages hidden as for a VLM; the pages' own text is the prompt a text teacher reads instead. The env's
    text never reaches the policy: a misread character stays in its prompt. Pages are read once
    (cached by key: a page stays in the window for several turns)."""

    spec: EnvSpec
    tokenizer: Any
    reader: ScreenReading
    read_pages: dict[str, str] = field(default_factory=dict, compare=False)

    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]], turns: Sequence[Turn],
               prior: Sequence[PriorStep] = ()) -> RenderedPrompt:
        text = chat_prompt_ids(self.tokenizer, self.spec.render_prompt(ctx))
        view, keys = screenshot_view(ctx, [info.get("screenshot", "") for info in infos], self.spec.screenshot_window)
        pages = iter(self.read(keys))  # the window's history pages in order, then the current page
        history = [(next(pages) if page == IMAGE_PLACEHOLDER else page, action) for page, action in view.history]
        view = replace(view, observation=next(pages), history=history)
        return RenderedPrompt(chat_prompt_ids(self.tokenizer, self.spec.render_prompt(view)), teacher_ids=text)

    def read(self, keys: Sequence[str]) -> list[str]:
        new = [key for key in dict.fromkeys(keys) if key not in self.read_pages]
        if new:
            if len(self.read_pages) > 4096:  # an SFT build's renderer reads thousands; a turn needs its window's
                self.read_pages.clear()
            screens = self.spec.pixel_store.get(new)
            self.read_pages.update(zip(new, self.reader.read([screens[key] for key in new]), strict=True))
        return [self.read_pages[key] for key in keys]


class ChatView(EnvAnswers):
    """prompt.style=chat: one conversation per episode. The first turn is the template's rendering of
    the system prompt (prompt.system, else the env's `system_prompt`, else none) and the env's prompt
    at step 0 as the user message; each later turn appends to the last turn's prompt and sampled
    action ids the template's answer closing (unless the policy sampled the end-of-turn token itself)
    and the observation as a user message (a tool message with prompt.tools). `max_prompt`: the most
    tokens a prompt may hold (the context less the answer's max_new_tokens)."""

    def __init__(self, spec: EnvSpec, tokenizer: Any, prompt: PromptConfig, max_prompt: int):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"prompt.style=chat: the policy tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) "
                             "has no chat template")
        self.spec, self.tokenizer, self.max_prompt = spec, tokenizer, max_prompt
        system = prompt.system if prompt.system is not None else getattr(spec, "system_prompt", EnvSpec.system_prompt)
        self.system = [{"role": "system", "content": system}] if system else []
        self.tools = [ACT_TOOL] if prompt.tools else None
        if self.tools:
            require_tools(tokenizer)
        self.closing = answer_closing(tokenizer, self.system, self.tools)
        self.observation_role = "tool" if self.tools else "user"

    def first_message(self, ctx: PromptContext) -> str:
        text = self.spec.render_prompt(ctx)
        return text.replace(answer_instruction(ctx.answer_format), TOOL_INSTRUCTION) if self.tools else text

    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]], turns: Sequence[Turn],
               prior: Sequence[PriorStep] = ()) -> RenderedPrompt | None:
        if turns:
            last = turns[-1]
            ids = self.appended(last.prompt_ids, last.action_ids, ctx)
        else:
            ids = self.conversation_before(ctx, prior)
        return RenderedPrompt(ids) if len(ids) <= self.max_prompt else None

    def conversation_before(self, ctx: PromptContext, prior: Sequence[PriorStep]) -> list[int]:
        """The first turn's prompt: the system prompt and the first message, then each prior step's
        action (as format_answer writes it) and the state it led to, as if the policy had played them."""
        states = [replace(ctx, step=i, observation=p.observation, history=[], admissible=p.admissible)
                  for i, p in enumerate(prior)] + [ctx]
        ids = list(self.tokenizer.apply_chat_template(
            [*self.system, {"role": "user", "content": self.first_message(states[0])}], tools=self.tools,
            tokenize=True, add_generation_prompt=True, return_dict=False))
        for step, state in zip(prior, states[1:], strict=True):
            answer = self.tokenizer.encode(self.format_answer(step.action, ctx.answer_format), add_special_tokens=False)
            ids = self.appended(ids, answer, state)
        return ids

    def appended(self, prompt_ids: Sequence[int], action_ids: Sequence[int], ctx: PromptContext) -> list[int]:
        """A prompt and its answer, closed, then ctx's observation as the next message."""
        text = self.closing_after(action_ids) + appended_text(
            self.tokenizer, self.system, self.tools, {"role": self.observation_role, "content": observation_message(ctx)})
        return [*prompt_ids, *action_ids, *self.tokenizer.encode(text, add_special_tokens=False)]

    def closing_after(self, action_ids: Sequence[int]) -> str:
        """The answer closing still to append after the sampled `action_ids`: all of it, or what follows
        a special end-of-turn token the policy sampled as its last token (ChatML: its <|im_end|>)."""
        if action_ids and action_ids[-1] in self.tokenizer.all_special_ids:
            sampled_end = self.tokenizer.convert_ids_to_tokens(action_ids[-1])
            if self.closing.startswith(sampled_end):
                return self.closing[len(sampled_end):]
        return self.closing

    def parse_action(self, text: str) -> ParsedAction:
        if not self.tools:
            return super().parse_action(text)
        action = parse_tool_call(text)
        if action is None:  # an invalid action: the env receives the raw text, as with a bad <action>
            return ParsedAction(action=" ".join(text.split())[:500], valid=False)
        return self.spec.parse_action(format_answer(action, "action"))  # the env's own normalization

    def format_answer(self, action: str, answer_format: str) -> str:
        return tool_call_text(action) if self.tools else format_answer(action, answer_format)


class TeacherTokens:
    """The student's view (`student`) for a teacher of another tokenizer (objective.tokenizers=cross):
    each prompt also rendered by the same kind of view over the teacher's tokenizer (`teacher`: the
    env's template in the teacher's chat template, or the conversation in it, built on the teacher's
    own reading of the earlier turns) as the prompt the teacher reads, and each action's text in the
    teacher's tokens with the spans aligning them to the sampled ids
    (turnopd.algorithm.token_alignment.cross_tokens)."""

    def __init__(self, student: Renderer, teacher: Renderer, student_tokenizer: Any, teacher_tokenizer: Any):
        self.student, self.teacher = student, teacher
        self.student_tokenizer, self.teacher_tokenizer = student_tokenizer, teacher_tokenizer

    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]], turns: Sequence[Turn],
               prior: Sequence[PriorStep] = ()) -> RenderedPrompt | None:
        shown = self.student.render(ctx, infos, turns, prior)
        if shown is None:
            return None
        theirs = self.teacher.render(ctx, infos, [teacher_reading(turn) for turn in turns], prior)
        return dataclasses.replace(shown, teacher_ids=theirs.ids)

    def parse_action(self, text: str) -> ParsedAction:
        return self.student.parse_action(text)

    def format_answer(self, action: str, answer_format: str) -> str:
        return self.student.format_answer(action, answer_format)

    def finish_turn(self, turn: Turn) -> Turn:
        cross = cross_tokens(self.student_tokenizer, self.teacher_tokenizer, turn.action_ids)
        return dataclasses.replace(self.student.finish_turn(turn), teacher_action_ids=cross.teacher_ids,
                                   token_spans=cross.spans)


def teacher_reading(turn: Turn) -> Turn:
    """A played turn as a teacher of another tokenizer read it: its prompt and action in that teacher's
    tokens (what a view over the teacher's tokenizer continues a conversation from)."""
    if turn.teacher_prompt_ids is None or turn.teacher_action_ids is None:
        raise ValueError(f"turn {turn.index} has no teacher tokens: it was played without the teacher's view")
    return dataclasses.replace(turn, prompt_ids=turn.teacher_prompt_ids, action_ids=turn.teacher_action_ids,
                               student_logprobs=[0.0] * len(turn.teacher_action_ids))


def observation_message(ctx: PromptContext) -> str:
    """A later turn's message in a chat: the env's observation and, where the env lists them, the
    admissible actions."""
    if not ctx.admissible:
        return ctx.observation
    return ctx.observation + "\nAdmissible actions: " + ", ".join(f"'{a}'" for a in ctx.admissible if a != "help")


def renderer_for(spec: EnvSpec, tokenizer: Any, *, image_tokens: int = 0, screen_reader: ScreenReading | None = None,
                 prompt: PromptConfig | None = None, max_prompt: int | None = None,
                 teacher_tokenizer: Any = None) -> Renderer:
    """The policy's view of `spec`'s turns: a chat for prompt.style=chat; else screenshots for a
    vision-language policy (`image_tokens` positions an image) in an env that shows them, the text a
    `screen_reader` reads off them for a text student that has one, else text (a policy that reads no
    images, e.g. the text teacher played as a policy in its evaluation, reads the pages' text).
    `max_prompt`: the most tokens a chat prompt may hold (None: no bound).
    `teacher_tokenizer`: a teacher of another tokenizer's (objective.tokenizers=cross), whose own
    view of every turn the returned `TeacherTokens` adds (the teacher's context is its max_length,
    checked as it scores)."""
    prompt = prompt or PromptConfig()
    if screen_reader is not None and (not shows_screenshots(spec) or image_tokens or teacher_tokenizer is not None):
        raise RecipeError(f"recipe key 'student.screen_reader': a text student in env {spec.name} that shows "
                          "screenshots reads them; not with an env of text, a vision-language student or "
                          "objective.tokenizers=cross")
    if teacher_tokenizer is not None:
        if shows_screenshots(spec) and image_tokens:
            raise RecipeError(f"recipe key 'objective.tokenizers': cross with env {spec.name}, which shows "
                              "screenshots to a vision-language student, is not built; use objective.tokenizers=match")
        return TeacherTokens(renderer_for(spec, tokenizer, prompt=prompt, max_prompt=max_prompt),
                             renderer_for(spec, teacher_tokenizer, prompt=prompt), tokenizer, teacher_tokenizer)
    if prompt.style == "chat":
        if shows_screenshots(spec):
            raise RecipeError(f"recipe key 'prompt.style': chat with env {spec.name}, which shows screenshots, is "
                              "not built; use prompt.style=history_block")
        return ChatView(spec, tokenizer, prompt, max_prompt if max_prompt is not None else sys.maxsize)
    if shows_screenshots(spec) and image_tokens:
        return ScreenshotView(spec, tokenizer, image_tokens)
    if screen_reader is not None:
        return ReadScreenView(spec, tokenizer, screen_reader)
    return TextView(spec, tokenizer)
