"""What the policy is shown each turn: a Renderer turns the turn's PromptContext (and the info of its
observations) into the token ids the policy reads.

`TextView` (every env): the env's template (task, step, current observation, the last
`env.history_length` (observation, action) pairs, admissible actions) as ONE user message wrapped in
the policy tokenizer's chat template, rendered afresh each turn (verl-agent style).
`ScreenshotView` (an env that shows screenshots, envs.base.shows_screenshots, and a vision-language
policy): the same template with an image in place of each page the window shows, and the pages'
text for a text teacher. `renderer_for` picks one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from envs.base import IMAGE_PLACEHOLDER, EnvSpec, PromptContext, screenshot_view, shows_screenshots
from turnopd.core.text import expand_placeholders


@dataclass(frozen=True)
class RenderedPrompt:
    """A turn's prompt: the ids the policy reads, the pixel-store keys of the images in them (in
    placeholder order), and the ids a teacher reads instead (None: `ids`)."""

    ids: list[int]
    image_keys: list[str] = field(default_factory=list)
    teacher_ids: list[int] | None = None


class Renderer(Protocol):
    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]]) -> RenderedPrompt:
        """The prompt of a turn. `infos`: the env's info of each observation in ctx.history, then the
        current observation's."""
        ...


def chat_prompt_ids(tokenizer: Any, user_message: str) -> list[int]:
    """The token ids of one user message in the tokenizer's chat template, ready for the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the policy tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template; "
                         "the rollout engine sends each prompt as a chat user message")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


@dataclass(frozen=True)
class TextView:
    spec: EnvSpec
    tokenizer: Any

    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]]) -> RenderedPrompt:
        return RenderedPrompt(chat_prompt_ids(self.tokenizer, self.spec.render_prompt(ctx)))


@dataclass(frozen=True)
class ScreenshotView:
    """A vision-language policy's view (`image_tokens` positions an image): see `student_prompt`."""

    spec: EnvSpec
    tokenizer: Any
    image_tokens: int

    def render(self, ctx: PromptContext, infos: Sequence[Mapping[str, Any]]) -> RenderedPrompt:
        ids, keys, text = student_prompt(self.spec, self.tokenizer, self.image_tokens, ctx,
                                         [info.get("screenshot", "") for info in infos])
        return RenderedPrompt(ids, keys, text)


def renderer_for(spec: EnvSpec, policy: Any) -> Renderer:
    """The policy's view of `spec`'s turns: screenshots for a vision-language policy in an env that
    shows them, else text (a policy that reads no images, e.g. the text teacher played as a policy in
    its evaluation, reads the pages' text)."""
    if shows_screenshots(spec) and policy.image_tokens:
        return ScreenshotView(spec, policy.tokenizer, policy.image_tokens)
    return TextView(spec, policy.tokenizer)


def student_prompt(spec: EnvSpec, tokenizer: Any, image_tokens: int, ctx: PromptContext, page_keys: Sequence[str]
                   ) -> tuple[list[int], list[str], list[int] | None]:
    """The token ids of a turn's prompt as the policy sees it, the screenshots they show and, in an
    env that shows screenshots (envs.base.shows_screenshots), the text prompt a text teacher reads
    instead: a vision-language policy's prompt (`image_tokens` positions an image) has an image in
    place of each page the window shows (envs.base.screenshot_view); a policy that reads no images
    (image_tokens 0) reads the pages' text. `page_keys`: the screenshot keys of ctx.history's pages,
    then the current page's."""
    text = chat_prompt_ids(tokenizer, spec.render_prompt(ctx))
    if not shows_screenshots(spec) or not image_tokens:
        return text, [], None
    view, keys = screenshot_view(ctx, page_keys, spec.screenshot_window)
    placeholder = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
    ids = chat_prompt_ids(tokenizer, spec.render_prompt(view))
    if ids.count(placeholder) != len(keys):
        raise ValueError(f"the policy's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) does not keep "
                         f"{IMAGE_PLACEHOLDER} as one token: {ids.count(placeholder)} in a prompt of {len(keys)} images")
    return expand_placeholders(ids, placeholder, image_tokens), keys, text
