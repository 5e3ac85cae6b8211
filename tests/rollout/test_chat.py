"""prompt.style=chat with SmolLM2-135M-Instruct's real tokenizer and ChatML template, on ALFWorld's
real prompt template: the engine's ids of a 5-turn conversation are the template's rendering of the
same messages, the end-of-turn token is appended once (or not at all when the policy sampled it),
the whole trajectory is one sequence whose loss mask covers exactly the sampled tokens, the
conversation ends as truncated when it would overflow its context, and tool calls are offered and
parsed (SmolLM2's template has no tool calling: refused; a ChatML template with tools built here)."""

from __future__ import annotations

import copy
import itertools

import pytest
from transformers import AutoTokenizer

from envs import make_env_spec
from envs.base import PromptContext
from turnopd.config import EnvConfig, PromptConfig, RecipeError
from turnopd.core.types import Trajectory, Turn, build_token_batch, trajectory_sequences
from turnopd.rollout.chat import parse_tool_call
from turnopd.rollout.render import ChatView, renderer_for

IM_START, IM_END, NEWLINE = 1, 2, 198  # SmolLM2's <|im_start|>, <|im_end|> (its EOS) and "\n"
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # its template's default
TASK = "put a pencil on desk 2."
OBSERVATIONS = ["You are in the middle of a room. You see a desk 1 and a desk 2.",
                "You arrive at desk 1. On the desk 1, you see a pencil 1.",
                "You pick up the pencil 1 from the desk 1.",
                "You arrive at desk 2. On the desk 2, you see nothing.",
                "Nothing happens."]
ADMISSIBLE = [["go to desk 1", "go to desk 2", "help"], ["take pencil 1 from desk 1", "go to desk 2"],
              ["go to desk 2", "inventory"], ["move pencil 1 to desk 2", "look"], ["look"]]
ACTIONS = ["<action>go to desk 1</action>", "<action>take pencil 1 from desk 1</action>",
           "<action>go to desk 2</action>", "<action>move pencil 1 to desk 2</action>", "<action>look</action>"]
# what each later turn's message reads, written out by hand (the admissible actions but 'help')
OBSERVATION_MESSAGES = [
    "You arrive at desk 1. On the desk 1, you see a pencil 1.\nAdmissible actions: 'take pencil 1 from desk 1', "
    "'go to desk 2'",
    "You pick up the pencil 1 from the desk 1.\nAdmissible actions: 'go to desk 2', 'inventory'",
    "You arrive at desk 2. On the desk 2, you see nothing.\nAdmissible actions: 'move pencil 1 to desk 2', 'look'",
    "Nothing happens.\nAdmissible actions: 'look'",
]

# ChatML with Hermes-style tools (as Qwen2.5's), for the tool-call tests: SmolLM2's template has none
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>"
    "{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}</tools><|im_end|>\n{%- endif %}\n"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ChatML that drops the reasoning of earlier answers (as Qwen3's template does)
THINK_DROPPING_TEMPLATE = (
    "{%- for message in messages %}{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last %}{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def spec():
    return make_env_spec(EnvConfig(name="alfworld", template="default", answer_format="action"))


def context(step: int) -> PromptContext:
    return PromptContext(task=TASK, step=step, observation=OBSERVATIONS[step], history=[],
                         admissible=ADMISSIBLE[step], answer_format="action")


def play(view: ChatView, tokenizer, actions: list[list[int]]) -> list[Turn]:
    """The turns of a conversation whose policy answered `actions` (token ids), as the engine renders them."""
    turns: list[Turn] = []
    for step, action_ids in enumerate(actions):
        prompt = view.render(context(step), [], turns)
        assert prompt is not None
        turns.append(Turn(index=step, observation=OBSERVATIONS[step], prompt_ids=prompt.ids, action_ids=action_ids,
                          student_logprobs=[-0.5] * len(action_ids), action_text=tokenizer.decode(action_ids)))
    return turns


def encoded(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def test_five_turns_are_the_templates_rendering_of_the_conversation(tokenizer, spec):
    view = ChatView(spec, tokenizer, PromptConfig(style="chat"), max_prompt=10_000)
    turns = play(view, tokenizer, encoded(tokenizer, ACTIONS))
    messages = [{"role": "user", "content": spec.render_prompt(context(0))}]
    for action, message in zip(ACTIONS[:4], OBSERVATION_MESSAGES, strict=True):  # turn 4 shows 4 answers
        messages += [{"role": "assistant", "content": action}, {"role": "user", "content": message}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert turns[-1].prompt_ids == list(expected)
    text = tokenizer.decode(turns[-1].prompt_ids)
    assert text.startswith(f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n<|im_start|>user\nYou are an expert agent")
    assert text.endswith("<|im_start|>user\nNothing happens.\nAdmissible actions: 'look'<|im_end|>\n"
                          "<|im_start|>assistant\n")
    for before, after in itertools.pairwise(turns):  # each prompt appends the sampled ids, then <|im_end|> "\n"
        n = len(before.prompt_ids)
        assert after.prompt_ids[:n] == before.prompt_ids
        assert after.prompt_ids[n: n + len(before.action_ids)] == before.action_ids
        assert after.prompt_ids[n + len(before.action_ids): n + len(before.action_ids) + 3] == [IM_END, NEWLINE, IM_START]


def test_a_sampled_end_of_turn_is_not_appended_again(tokenizer, spec):
    view = ChatView(spec, tokenizer, PromptConfig(style="chat"), max_prompt=10_000)
    actions = [ids + [IM_END] for ids in encoded(tokenizer, ACTIONS[:2])]  # the policy stopped on its EOS
    turns = play(view, tokenizer, actions)
    n = len(turns[0].prompt_ids) + len(actions[0])
    assert turns[1].prompt_ids[n - 1: n + 2] == [IM_END, NEWLINE, IM_START]  # its own <|im_end|>, then "\n"
    assert turns[1].prompt_ids.count(IM_END) == 4  # the system's, the task's, the sampled one, the observation's


def test_the_trajectory_is_one_sequence_and_the_mask_covers_the_sampled_tokens(tokenizer, spec):
    view = ChatView(spec, tokenizer, PromptConfig(style="chat"), max_prompt=10_000)
    actions = encoded(tokenizer, ACTIONS)
    actions[2] = actions[2] + [IM_END]  # one answer stopped on the sampled EOS: it is trained
    trajectory = Trajectory(task_id="t", env_name="alfworld", turns=play(view, tokenizer, actions))
    for reader in ("student", "teacher"):
        (sequence,) = trajectory_sequences(trajectory, reader)
        assert [sequence.ids[start:end] for start, end, _ in sequence.spans] == actions
    batch = build_token_batch([trajectory])
    assert batch.seq_lens.tolist() == [len(trajectory.turns[-1].prompt_ids) + len(actions[-1])]
    assert batch.input_ids[batch.loss_mask].tolist() == [t for ids in actions for t in ids]
    # <|im_end|> closes the system message, the task, the 4 observations and the 4 answers before the last
    # (the last is open): 10, of which only the sampled one, answer 2's, is trained
    assert batch.input_ids.tolist().count(IM_END) == 10
    assert batch.input_ids[batch.loss_mask].tolist().count(IM_END) == 1


def test_a_conversation_that_would_overflow_its_context_ends(tokenizer, spec):
    long_enough = ChatView(spec, tokenizer, PromptConfig(style="chat"), max_prompt=10_000)
    turns = play(long_enough, tokenizer, encoded(tokenizer, ACTIONS[:3]))
    limit = len(turns[2].prompt_ids) - 1  # turn 2's prompt is one token too long
    view = ChatView(spec, tokenizer, PromptConfig(style="chat"), max_prompt=limit)
    assert view.render(context(1), [], turns[:1]) is not None
    assert view.render(context(2), [], turns[:2]) is None


def test_the_system_prompt_is_the_recipes(tokenizer, spec):
    view = ChatView(spec, tokenizer, PromptConfig(style="chat", system="You play ALFWorld."), max_prompt=10_000)
    text = tokenizer.decode(view.render(context(0), [], []).ids)
    assert text.startswith("<|im_start|>system\nYou play ALFWorld.<|im_end|>\n<|im_start|>user\n")
    assert SMOL_SYSTEM not in text


def test_tools_on_a_template_without_tool_calling_are_refused(tokenizer, spec):
    with pytest.raises(RecipeError, match=r"'prompt.tools'.*ignores tools="):
        renderer_for(spec, tokenizer, prompt=PromptConfig(style="chat", tools=True))


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    tool_tokenizer = copy.deepcopy(tokenizer)
    tool_tokenizer.chat_template = TOOL_TEMPLATE
    return tool_tokenizer


def test_tool_calls_offer_the_act_tool_and_answer_with_tool_messages(tool_tokenizer, spec):
    view = renderer_for(spec, tool_tokenizer, prompt=PromptConfig(style="chat", tools=True))
    call = view.format_answer("go to desk 1", "action")
    assert call == '<tool_call>\n{"name": "act", "arguments": {"action": "go to desk 1"}}\n</tool_call>'
    turns = play(view, tool_tokenizer, encoded(tool_tokenizer, [call]))
    text = tool_tokenizer.decode(view.render(context(1), [], turns).ids)
    assert text.startswith('<|im_start|>system\nYou may call these tools:\n<tools>{"type": "function", '
                           '"function": {"name": "act"')
    assert "by calling the tool `act`" in text and "<action> </action>" not in text  # the env's instruction swapped
    assert text.endswith(f"{call}<|im_end|>\n<|im_start|>tool\n{OBSERVATION_MESSAGES[0]}<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert view.parse_action(call).action == "go to desk 1" and view.parse_action(call).valid


@pytest.mark.parametrize(("answer", "action"), [
    ('<tool_call>\n{"name": "act", "arguments": {"action": "Go to desk 1"}}\n</tool_call>', "Go to desk 1"),
    ('I go there. <tool_call>{"name": "act", "arguments": {"action": "look"}}', "look"),  # cut at the stop string
    ('<tool_call>{"name": "act", "arguments": "{\\"action\\": \\"look\\"}"}</tool_call>', "look"),  # string arguments
    ('<tool_call>{"name": "act", "arguments": {"action": "a"}}</tool_call><tool_call>{"name": "act", '
     '"arguments": {"action": "b"}}</tool_call>', "b"),  # the last call
    ("<action>look</action>", None),  # no tool call
    ('<tool_call>{"name": "act", "arguments": {"action": "look"}</tool_call>', None),  # a brace short
    ('<tool_call>{"name": "search", "arguments": {"action": "look"}}</tool_call>', None),  # another tool
    ('<tool_call>{"name": "act", "arguments": {"command": "look"}}</tool_call>', None),  # no action argument
    ('<tool_call>{"name": "act", "arguments": {"action": "  "}}</tool_call>', None),  # an empty action
    ('<tool_call>["act", "look"]</tool_call>', None),  # not an object
])
def test_tool_call_parsing(answer, action):
    assert parse_tool_call(answer) == action


def test_a_malformed_tool_call_is_an_invalid_action(tool_tokenizer, spec):
    view = renderer_for(spec, tool_tokenizer, prompt=PromptConfig(style="chat", tools=True))
    parsed = view.parse_action('<tool_call>{"name": "act", "arguments": {"action": "Go to desk 1"}}</tool_call>')
    assert (parsed.action, parsed.valid) == ("go to desk 1", True)  # ALFWorld's own parser folds the case
    parsed = view.parse_action('<tool_call>{"name": "act"')
    assert (parsed.action, parsed.valid) == ('<tool_call>{"name": "act"', False)


def test_a_template_that_drops_earlier_reasoning_is_not_followed(tokenizer, spec):
    """The engine never re-renders: the policy keeps reading its earlier answers as it sampled them,
    reasoning included, where the template would drop it."""
    dropping = copy.deepcopy(tokenizer)
    dropping.chat_template = THINK_DROPPING_TEMPLATE
    view = ChatView(spec, dropping, PromptConfig(style="chat"), max_prompt=10_000)
    answer = "<think>The lamp is on desk 1.</think><action>go to desk 1</action>"
    turns = play(view, dropping, encoded(dropping, [answer, ACTIONS[1]]))
    engine = dropping.decode(turns[1].prompt_ids)
    assert f"<|im_start|>assistant\n{answer}<|im_end|>\n<|im_start|>user\n{OBSERVATION_MESSAGES[0]}" in engine
    rendered = dropping.apply_chat_template([
        {"role": "user", "content": spec.render_prompt(context(0))}, {"role": "assistant", "content": answer},
        {"role": "user", "content": OBSERVATION_MESSAGES[0]}], add_generation_prompt=True, tokenize=False)
    assert "The lamp is on desk 1." not in rendered and engine != rendered
