"""The verifiers adapter on real verifiers tasksets (the `verifiers` extra; the tests skip without it):
TextArena's GuessTheNumber played by verifiers' own TextArenaEnv (the engine answers each move;
turnopd_textarena), and one-answer sums scored by two weighted rewards (verifiers' SingleAgentEnv; a
module of tests/envs/verifiers_tasksets, importable by id as an installed taskset package is)."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from envs import make_env_spec
from envs.base import ParsedAction, PromptContext
from envs.pool import EnvPool
from tests.conftest import child_env, hide_package
from turnopd.cli import main
from turnopd.config import EnvConfig, PromptConfig
from turnopd.core.metrics import read_metrics
from turnopd.core.types import Turn

pytest.importorskip("verifiers.v1")
ta = pytest.importorskip("textarena")

TASKSETS = Path(__file__).parent / "verifiers_tasksets"
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "verifiers" / "guess_the_number.yaml"
GUESS = {"taskset": "turnopd_textarena", "train_tasks": 3, "test_tasks": 1}
SUMS = {"taskset": "vf_sums", "train_tasks": 4, "test_tasks": 2}


@pytest.fixture(autouse=True)
def _tasksets_importable(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(TASKSETS))  # the pool's spawned workers inherit sys.path


def spec_of(**options):
    return make_env_spec(EnvConfig(name="verifiers", options=options))


def reset_game(seed: int):
    """TextArena's GuessTheNumber reset under `seed` (its RNG is process-global)."""
    random.seed(seed)
    game = ta.make(env_id="GuessTheNumber-v0")
    game.reset(num_players=1)
    return game


def first_observation(seed: int) -> str:
    return str(reset_game(seed).get_observation()[1])


def test_guess_the_number_plays_through_the_pool() -> None:
    from verifiers.v1.tasksets.textarena.taskset import SYSTEM_PROMPT

    spec = spec_of(**GUESS)
    assert spec.tasks("train") == ["task-0", "task-1", "task-2"] and spec.tasks("test") == ["task-3"]
    assert spec.system_prompt == SYSTEM_PROMPT  # the chat's system prompt: the taskset's
    assert (reset_game(0).game_number, reset_game(1).game_number) == (13, 5)  # the numbers TextArena hides under seeds 0 and 1 (1 to 20)
    with EnvPool(spec, num_workers=1, step_timeout_s=120) as pool:
        start = pool.reset(["task-0", "task-1"])
        assert [s.observation for s in start] == [first_observation(0), first_observation(1)]
        assert start[0].info["task"] == "GuessTheNumber-v0#0" and start[0].admissible is None
        hints = pool.step({0: "Halfway: [10]", 1: "[1]"})
        assert (hints[0].observation, hints[1].observation) == ("The target number is higher.",
                                                               "The target number is higher.")
        assert pool.step({0: "[20]"})[0].observation == "The target number is lower."
        won = pool.step({0: "Then it is [13]"})[0]
        assert (won.observation, won.reward, won.done, won.won) == ("", 1.0, True, True)
        repeat = pool.step({1: "[1]"})[1]  # a repeated guess: TextArena's one allowed invalid move, warned
        assert repeat.observation.startswith("You attempted an invalid move.") and not repeat.done
        # the second invalid move ends the game with TextArena's partial reward: 1 - |last guess - target| / 19
        lost = pool.step({1: "[1]"})[1]
        assert (lost.reward, lost.done, lost.won) == (pytest.approx(1 - 4 / 19), True, False)


def test_the_chat_is_the_verifiers_conversation(smollm2_tokenizer_dir) -> None:
    """prompt.style=chat renders the episode (SmolLM2's ChatML) exactly as the template renders the
    verifiers trace's messages: its system prompt, the task's prompt, the answers, the engine's answers."""
    from transformers import AutoTokenizer

    from turnopd.rollout.render import ChatView

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    spec = spec_of(**GUESS)
    view = ChatView(spec, tokenizer, PromptConfig(style="chat"), max_prompt=10_000)
    env = spec.make()
    try:
        outcome, turns = env.reset("task-0"), []
        for step, answer in enumerate(["I guess [10]", "[20]", None]):
            ctx = PromptContext(task=outcome.info.get("task", ""), step=step, observation=outcome.observation, history=[])
            prompt = view.render(ctx, [], turns)
            if answer is None:
                break
            ids = tokenizer.encode(answer, add_special_tokens=False)
            turns.append(Turn(index=step, observation=outcome.observation, prompt_ids=prompt.ids, action_ids=ids,
                              student_logprobs=[0.0] * len(ids), action_text=answer))
            outcome = env.step(spec.parse_action(answer).action)
        messages = [{"role": m.role, "content": m.content} for m in env.traces[0].messages]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert prompt.ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    finally:
        env.close()


def test_the_conversation_is_the_verifiers_trace() -> None:
    env = spec_of(**GUESS).make()
    try:
        env.reset("task-0")
        env.step("[10]")
        env.step("[13]")
        (trace,) = env.traces
        assert [(m.role, m.content) for m in trace.messages[2:]] == [
            ("assistant", "[10]"), ("user", "The target number is higher."), ("assistant", "[13]")]
        assert trace.messages[1].content == first_observation(0) and trace.rewards["game_reward"].score == 1.0
    finally:
        env.close()


@pytest.mark.parametrize("answer, reward", [("7", 1.5), ("The answer is 7, I am sure.", 1.0), ("8", 0.5)])
def test_weighted_rewards_are_the_outcome(answer, reward) -> None:
    """correct (weight 1) and brief (weight 0.5: at most 20 characters), on "What is 2 + 5?"."""
    spec = spec_of(**SUMS)
    env = spec.make()
    start = env.reset("task-2")
    assert (start.observation, spec.system_prompt) == ("What is 2 + 5?", "Answer with the number only.")
    outcome = env.step(answer)
    assert (outcome.reward, outcome.done, outcome.won) == (reward, True, reward >= 1.0)
    strict = spec_of(**SUMS, success_reward=1.5).make()
    strict.reset("task-2")
    assert strict.step(answer).won == (reward == 1.5)


def test_an_episode_stopped_early_leaves_nothing_running() -> None:
    env = spec_of(**GUESS).make()
    env.reset("task-0")
    env.step("[10]")
    env.close()  # the pool's end of an episode cut at max_turns: the env's run is cancelled
    assert env.reset("task-0").observation == first_observation(0)
    env.close()


def test_the_answer_is_the_action_and_the_prompt_the_first_message() -> None:
    spec = spec_of(**SUMS)
    assert spec.parse_action("  The answer is [7]\n") == ParsedAction("The answer is [7]", True)
    ctx = PromptContext(task="t", step=0, observation="What is 2 + 5?", history=[])
    assert spec.render_prompt(ctx) == "What is 2 + 5?"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"taskset": None}, "env verifiers needs option `taskset`, a verifiers taskset id (an installed module "
                            "that exports a Taskset), e.g. env.options.taskset=my_tasks"),
        ({"taskset": "no_such_tasks"}, "verifiers taskset 'no_such_tasks': taskset 'no_such_tasks' not found (tried "
                                       "to import 'no_such_tasks'). A taskset is a package exporting its Taskset "
                                       "subclass via `__all__` — the built-in ones ship with verifiers in the "
                                       "`verifiers.v1.tasksets` package; any other package must already be installed."),
        ({**SUMS, "taskset_args": {"num_tasks": "many"}},
         "verifiers taskset 'vf_sums': taskset.num_tasks: Input should be a valid integer, unable to parse string "
         "as an integer"),
        ({**SUMS, "taskset_args": {"num_tasks": 5}}, "verifiers taskset 'vf_sums' has 5 tasks; train_tasks + "
                                                     "test_tasks is 6"),
        ({**SUMS, "env_id": "user-sim"}, "verifiers env UserSimEnvConfig has agent seats ['assistant', 'user']; the "
                                         "adapter plays envs with one seat (the policy's)"),
        ({**GUESS, "taskset_args": {"game": "Wordle-v0"}},
         "verifiers taskset 'turnopd_textarena': taskset.game: Input should be 'GuessTheNumber-v0', 'TowerOfHanoi-v0', "
         "'Minesweeper-v0', 'FrozenLake-v0', 'Mastermind-v0', 'Sudoku-v0' or 'Crosswords-v0'"),
        ({**SUMS, "colour": "red"}, "unknown verifiers options ['colour']; allowed: taskset, taskset_args, env_id, "
                                    "success_reward, train_tasks, test_tasks"),
    ],
)
def test_bad_options_are_refused(options, message) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        spec_of(**options)


def test_a_wrong_task_type_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^unknown verifiers task types \['sums'\]; allowed: vf_sums$"):
        make_env_spec(EnvConfig(name="verifiers", task_types=["sums"], options=SUMS))


def test_without_verifiers_the_error_gives_the_install_line(monkeypatch) -> None:
    hide_package(monkeypatch, "verifiers")
    with pytest.raises(ValueError, match=r"^env verifiers needs the verifiers package \(0\.4, verifiers\.v1\), which "
                                         r"is not installed: pip install -e \"\.\[verifiers\]\"$"):
        spec_of(**SUMS)


def test_the_recipe_check_gives_the_install_line_without_verifiers(monkeypatch, capsys) -> None:
    hide_package(monkeypatch, "verifiers")
    assert main(["show", str(RECIPE)]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: recipe key 'env' (env verifiers): env verifiers needs the verifiers package (0.4, verifiers.v1), "
        'which is not installed: pip install -e ".[verifiers]"')


@pytest.mark.slow
def test_two_distillation_steps_on_guess_the_number(tmp_path, smollm2_tokenizer_dir, smollm2_tiny_model_dir) -> None:
    """A chat run on the recipe's taskset with tiny random models that share SmolLM2's tokenizer."""
    from turnopd.models.tiny import build_tiny_model

    build_tiny_model(tmp_path / "student", tokenizer=smollm2_tokenizer_dir, hidden_size=64, num_layers=1, num_heads=2,
                     max_position_embeddings=4096, seed=7)
    (tmp_path / "teacher.yaml").write_text(f"name: tiny-teacher\nmodel: {smollm2_tiny_model_dir}\n"
                                           "backend: transformers\ndtype: float32\nmax_length: 4096\n")
    run = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(RECIPE), "name=guess",
                          f"output_dir={tmp_path / 'runs'}", f"student.path={tmp_path / 'student'}", "student.prepare=null",
                          f"teachers.verifiers={tmp_path / 'teacher.yaml'}", "env.max_turns=3", "env.num_workers=1",
                          "env.options.train_tasks=4", "env.options.test_tasks=1", "prompt.max_context=4096",
                          "policy.max_new_tokens=6", "trainer.steps=2", "trainer.episodes_per_step=2",
                          "eval.max_tasks=1", "eval.at_start=false", "tracking=[]"],
                         env=child_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    train = [r for r in read_metrics(tmp_path / "runs" / "guess" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["tokens_trained"] > 0 for r in train)
