"""The pieces of a chat template that prompt.style=chat appends to a conversation (docs/chat.md).

A chat episode's prompt only grows: turn t's prompt is turn t-1's prompt, the action ids the policy
sampled, the text the template writes after an answer (ChatML: `<|im_end|>\n`), then the next
observation's message and the generation prompt. The template is asked for those pieces on a fixed
plain conversation (`answer_closing`, `appended_text`), never to re-render the episode, so what the
policy once read stays as it read it (a template that rewrites earlier turns, e.g. drops their
reasoning, is not followed: docs/chat.md).

Native tool calls (prompt.tools): the env's actions are one tool, `act`, offered through the
template's `tools=`; an answer is parsed as a Hermes-style `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` (the format of Qwen2.5/3, Hermes and SmolLM3 templates).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from turnopd.config import RecipeError

Message = Mapping[str, Any]

PLAIN_USER: Message = {"role": "user", "content": "Hello."}
PLAIN_ANSWER = "Hi."

ACT_TOOL = {
    "type": "function",
    "function": {
        "name": "act",
        "description": "Take one action in the environment; its answer is what happens.",
        "parameters": {
            "type": "object",
            "properties": {"action": {"type": "string", "description": "the action, e.g. one of the admissible ones"}},
            "required": ["action"],
        },
    },
}
TOOL_INSTRUCTION = "Take your action for the current step by calling the tool `act`."

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def render_text(tokenizer: Any, messages: Sequence[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def answer_closing(tokenizer: Any, system: Sequence[Message], tools: list[dict] | None) -> str:
    """The text the template writes after an assistant message's content (ChatML: '<|im_end|>\\n')."""
    opened = render_text(tokenizer, [*system, PLAIN_USER], tools, True)
    closed = render_text(tokenizer, [*system, PLAIN_USER, {"role": "assistant", "content": PLAIN_ANSWER}], tools, False)
    if not closed.startswith(opened + PLAIN_ANSWER):
        raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')} does not write an answer "
                         "right after its generation prompt; prompt.style=chat cannot append to it")
    return closed[len(opened) + len(PLAIN_ANSWER):]


def appended_text(tokenizer: Any, system: Sequence[Message], tools: list[dict] | None, message: Message) -> str:
    """The text the template writes for `message` after a closed assistant turn, with the next
    generation prompt."""
    before = [*system, PLAIN_USER, {"role": "assistant", "content": PLAIN_ANSWER}]
    closed = render_text(tokenizer, before, tools, False)
    full = render_text(tokenizer, [*before, message], tools, True)
    if not full.startswith(closed):
        raise ValueError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')} re-renders a conversation "
                         f"when a {message['role']} message is added; prompt.style=chat cannot append to it")
    return full[len(closed):]


def require_tools(tokenizer: Any) -> None:
    """prompt.tools needs a chat template that shows the tools it is given (transformers passes `tools=`
    to every template, and one without tool support silently ignores it)."""
    plain = render_text(tokenizer, [PLAIN_USER], None, True)
    if render_text(tokenizer, [PLAIN_USER], [ACT_TOOL], True) == plain:
        raise RecipeError(f"recipe key 'prompt.tools': the chat template of {getattr(tokenizer, 'name_or_path', '?')} "
                          "ignores tools= (it has no tool calling); set prompt.tools=false")


def tool_call_text(action: str) -> str:
    """A call of the tool `act` with `action`, as the model writes it (an expert's answer)."""
    return "<tool_call>\n" + json.dumps({"name": "act", "arguments": {"action": action}}) + "\n</tool_call>"


def parse_tool_call(text: str) -> str | None:
    """The `action` argument of the answer's last call of the tool `act`, or None when the answer
    holds no such call (no <tool_call>, bad JSON, another tool, no string action). The closing
    </tool_call> may be missing: generation stops at it as a stop string."""
    calls = _TOOL_CALL_RE.findall(text)
    if not calls:
        return None
    try:
        call = json.loads(calls[-1])
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") != "act":
        return None
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    action = arguments.get("action") if isinstance(arguments, dict) else None
    return action if isinstance(action, str) and action.strip() else None
