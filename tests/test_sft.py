"""Teacher SFT: demonstrations rendered as the rollout engine renders turns, loss on answer tokens
only, the recipe schema, and (slow) a whole `turnopd sft` run on real ALFWorld games."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.base import PromptContext, StepOutcome, extract_action, format_answer
from envs.demonstrations import (
    Demonstration,
    DemoStep,
    demo_cache_path,
    demo_tasks,
    play_experts,
    require_relabelling_expert,
)
from tests.doubles import InProcessPool
from turnopd.config import EnvConfig, PromptConfig, RecipeError, TrainerConfig, compose
from turnopd.orchestration.sft import (
    SFTConfig,
    batches,
    demo_examples,
    example_batch,
    freeze_below_top_layers,
    load_sft_recipe,
    run_sft,
)
from turnopd.rollout import Generation, Policy, SamplingParams
from turnopd.rollout.agent_loop import rollout

# ---- a small in-process env: walk to desk 1, 2, ..., n in order --------------------------------


class WalkEnv:
    def reset(self, task_id: str) -> StepOutcome:
        self.goal, self.at = int(task_id.split("-")[1]), 0
        return StepOutcome(self._observation(), admissible=self._admissible(), info={"task": f"reach desk {self.goal}"})

    def step(self, action: str) -> StepOutcome:
        invalid = action != f"go to desk {self.at + 1}"
        self.at += not invalid
        won = self.at == self.goal
        return StepOutcome(self._observation() if not invalid else "Nothing happens.", done=won, won=won,
                           admissible=self._admissible(), info={"invalid": invalid})

    def _observation(self) -> str:
        return f"You are at desk {self.at}." if self.at else "You are in the middle of a room."

    def _admissible(self) -> list[str]:
        return [f"go to desk {i}" for i in range(1, self.goal + 1)] + ["look"]

    def close(self) -> None:
        pass


class WalkExpert:
    def __init__(self) -> None:
        self.next = 1

    def act(self, outcome: StepOutcome) -> str:
        self.next += 1
        return f"go to desk {self.next - 1}"


class WalkSpec:
    name = "walk"
    default_max_turns = 10
    observation_version = "1"

    def splits(self) -> list[str]:
        return ["train"]

    def tasks(self, split: str) -> list[str]:
        return [f"{kind}-{n}" for kind in ("near", "far") for n in ((1, 2) if kind == "near" else (3, 4))]

    def task_type(self, task_id: str) -> str:
        return task_id.split("-")[0]

    def make(self) -> WalkEnv:
        return WalkEnv()

    def expert(self, task_id: str) -> WalkExpert:
        return WalkExpert()

    def parse_action(self, text: str):
        return extract_action(text)

    def render_prompt(self, ctx: PromptContext) -> str:
        history = " | ".join(f"{obs} -> {act}" for obs, act in ctx.history)
        return (f"Task: {ctx.task}. Step {ctx.step}. History: [{history}]. Now: {ctx.observation} "
                f"Actions: {', '.join(ctx.admissible or [])}. ({ctx.answer_format})")


class ScriptedPolicy(Policy):
    """Answers each prompt with the expert's next action of its episode (found by the task in it)."""

    weight_version = 0
    max_model_len = 10_000

    def __init__(self, tokenizer, answer_format: str):
        self.tokenizer, self.answer_format = tokenizer, answer_format

    def session(self):
        return contextlib.nullcontext()

    async def generate(self, prompt: list[int], sampling: SamplingParams, image_keys=()) -> Generation:
        step = int(self.tokenizer.decode(prompt).split("Step ")[1].split(".")[0])
        answer = format_answer(f"go to desk {step + 1}", self.answer_format)
        ids = self.tokenizer.encode(answer, add_special_tokens=False)
        return Generation(ids, [0.0] * len(ids), answer)


# ---- demonstrations ------------------------------------------------------------------------------


def test_demo_tasks_alternate_task_types_and_sample_each_type() -> None:
    spec = WalkSpec()
    tasks = demo_tasks(spec, "train", 3, seed=0)
    assert [spec.task_type(t) for t in tasks] == ["far", "near", "far"]
    everything = demo_tasks(spec, "train", 10, seed=0)
    assert sorted(everything) == sorted(spec.tasks("train"))  # capped at the split's size
    assert tasks == everything[:3]  # a smaller n is a prefix: cached episodes are reused
    orders = {tuple(demo_tasks(spec, "train", 4, seed=s)) for s in range(20)}
    assert len(orders) == 4  # (far-3 | far-4 first) x (near-1 | near-2 first): every order occurs


def test_play_experts_records_what_the_expert_saw_and_did() -> None:
    spec = WalkSpec()
    demos = list(play_experts(spec, InProcessPool(spec), ["near-2", "far-3"], max_turns=10))
    assert [d.task_id for d in demos] == ["near-2", "far-3"]
    assert all(d.won for d in demos)
    assert [s.action for s in demos[1].steps] == ["go to desk 1", "go to desk 2", "go to desk 3"]
    assert [s.observation for s in demos[1].steps] == ["You are in the middle of a room.", "You are at desk 1.",
                                                      "You are at desk 2."]
    assert demos[0].task == "reach desk 2" and demos[0].task_type == "near"


def test_play_experts_stops_at_max_turns_and_keeps_lost_episodes() -> None:
    spec = WalkSpec()
    (demo,) = play_experts(spec, InProcessPool(spec), ["far-4"], max_turns=2)
    assert not demo.won and len(demo.steps) == 2


def test_demonstration_json_round_trip() -> None:
    demo = Demonstration("t", "near", "goal", True, [DemoStep("obs", ["a", "b"], "a")])
    assert Demonstration.from_json(json.dumps(asdict(demo))) == demo


@pytest.mark.parametrize("answer_format", ["action", "think_action"])
@pytest.mark.parametrize("history_length", [0, 2])
def test_examples_are_the_turns_the_rollout_engine_renders(tiny_model_dir: Path, answer_format: str,
                                                           history_length: int) -> None:
    """A student that plays the expert's actions sees, turn by turn, exactly the SFT prompt and
    generates exactly the SFT answer tokens."""
    spec = WalkSpec()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env_config = EnvConfig(name="alfworld", history_length=history_length, answer_format=answer_format, max_turns=10)
    demos = list(play_experts(spec, InProcessPool(spec), ["far-4", "near-2"], max_turns=10))
    examples = demo_examples(demos, spec, env_config, tok)

    played = rollout(spec, InProcessPool(spec), ScriptedPolicy(tok, answer_format), ["far-4", "near-2"],
                     env_config=env_config, sampling=SamplingParams(temperature=0))
    turns = [turn for traj in played for turn in traj.turns]
    assert all(traj.success for traj in played)
    assert [(ex.prompt_ids, ex.answer_ids) for ex in examples] == [(t.prompt_ids, t.action_ids) for t in turns]
    assert [ex.turn for ex in examples] == [0, 1, 2, 3, 0, 1]


def test_lost_demonstrations_are_not_trained_on(tiny_model_dir: Path) -> None:
    spec = WalkSpec()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    demos = list(play_experts(spec, InProcessPool(spec), ["far-4", "near-1"], max_turns=2))
    examples = demo_examples(demos, spec, EnvConfig(name="alfworld"), tok)
    assert [ex.task_id for ex in examples] == ["near-1"]


class DetourExpert(WalkExpert):
    """Walks the desks, but marks every other turn as a deliberate mistake (`exploring`)."""

    def act(self, outcome: StepOutcome) -> str:
        action = super().act(outcome)
        self.exploring = self.next % 2 == 0
        return action


def test_an_exploring_experts_mistakes_are_played_not_imitated(tiny_model_dir: Path) -> None:
    spec = WalkSpec()
    spec.expert = lambda task_id: DetourExpert()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (demo,) = play_experts(spec, InProcessPool(spec), ["far-4"], max_turns=10)
    assert [step.imitate for step in demo.steps] == [False, True, False, True]  # turns 0..3, next = 1..4
    examples = demo_examples([demo], spec, EnvConfig(name="alfworld", history_length=2), tok)
    assert [ex.turn for ex in examples] == [1, 3]
    # the history a trained turn shows still holds the mistake that was played before it
    assert "-> go to desk 1]" in tok.decode(examples[0].prompt_ids)


class WalkRelabeller(WalkExpert):
    """Follows another player: tracks its desk from the env's answers (a refused step does not move
    it) and labels the next desk; after a refused step it says "fly", which the env never admits."""

    def __init__(self) -> None:
        self.at, self.refused, self.followed = 0, False, False

    def label(self, outcome: StepOutcome) -> str:
        if self.followed:
            self.refused = outcome.observation == "Nothing happens."
            self.at += not self.refused
        return "fly" if self.refused else f"go to desk {self.at + 1}"

    def follow(self, command: str) -> None:
        self.followed = True


def test_relabelled_states_are_the_players_with_the_experts_answers(tiny_model_dir: Path) -> None:
    spec = WalkSpec()
    spec.expert = lambda task_id: WalkRelabeller()
    played = ["go to desk 1", "go to desk 3", "go to desk 2", "look"]  # a wrong desk, then a refused look
    (demo,) = play_experts(spec, InProcessPool(spec), ["far-3"], max_turns=10, followed=[played])
    assert demo.relabelled and not demo.won  # the player's outcome; its states are trained on all the same
    assert [s.action for s in demo.steps] == played  # the commands run out: the episode ends there
    assert [s.label for s in demo.steps] == ["go to desk 1", "go to desk 2", "fly", "go to desk 3"]
    assert [s.imitate for s in demo.steps] == [True, True, False, True]  # "fly" is not admissible
    assert Demonstration.from_json(json.dumps(asdict(demo))) == demo

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = demo_examples([demo], spec, EnvConfig(name="alfworld", history_length=1), tok)
    assert [ex.turn for ex in examples] == [0, 1, 3]
    assert [tok.decode(ex.answer_ids) for ex in examples] == [
        format_answer(a, "think_action") for a in ("go to desk 1", "go to desk 2", "go to desk 3")]
    # the history shows what the player did at turn 2, not the expert's label
    assert "History: [Nothing happens. -> go to desk 2]" in tok.decode(examples[2].prompt_ids)


def test_chat_demonstrations_are_one_conversation_of_the_played_actions(smollm2_tokenizer_dir: Path) -> None:
    """prompt.style=chat: a demonstration's turns are one growing conversation (SmolLM2's template)
    whose assistant messages are what was played, while each trained answer is the expert's label."""
    spec = WalkSpec()
    spec.expert = lambda task_id: WalkRelabeller()
    played = ["go to desk 1", "go to desk 3", "go to desk 2", "look"]
    (demo,) = play_experts(spec, InProcessPool(spec), ["far-3"], max_turns=10, followed=[played])
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    env = EnvConfig(name="alfworld", answer_format="action")
    examples = demo_examples([demo], spec, env, tok, prompt=PromptConfig(style="chat"))
    assert [ex.turn for ex in examples] == [0, 1, 3]
    assert [tok.decode(ex.answer_ids) for ex in examples] == [
        f"<action>{a}</action>" for a in ("go to desk 1", "go to desk 2", "go to desk 3")]
    actions = "Actions: go to desk 1, go to desk 2, go to desk 3, look"
    messages = [{"role": "user", "content": f"Task: reach desk 3. Step 0. History: []. Now: You are in the middle "
                                            f"of a room. {actions}. (action)"}]
    for action, observation in zip(played[:3], ["You are at desk 1.", "Nothing happens.", "You are at desk 2."],
                                   strict=True):
        messages += [{"role": "assistant", "content": f"<action>{action}</action>"},
                     {"role": "user", "content": f"{observation}\nAdmissible actions: " + ", ".join(
                         f"'{a}'" for a in actions.removeprefix("Actions: ").split(", "))}]
    assert examples[2].prompt_ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)


def test_chat_demonstrations_with_tools_answer_with_tool_calls(smollm2_tokenizer_dir: Path) -> None:
    """prompt.tools: the expert's answers are calls of the tool `act`, and the env's answers tool messages."""
    from tests.rollout.test_chat import TOOL_TEMPLATE

    spec = WalkSpec()
    (demo,) = play_experts(spec, InProcessPool(spec), ["near-2"], max_turns=10)
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.chat_template = TOOL_TEMPLATE
    examples = demo_examples([demo], spec, EnvConfig(name="alfworld", answer_format="action"), tok,
                             prompt=PromptConfig(style="chat", tools=True))
    calls = [f'<tool_call>\n{{"name": "act", "arguments": {{"action": "go to desk {n}"}}}}\n</tool_call>' for n in (1, 2)]
    assert [tok.decode(ex.answer_ids) for ex in examples] == calls
    assert tok.decode(examples[1].prompt_ids).endswith(
        f"<|im_start|>assistant\n{calls[0]}<|im_end|>\n<|im_start|>tool\nYou are at desk 1.\nAdmissible actions: "
        "'go to desk 1', 'go to desk 2', 'look'<|im_end|>\n<|im_start|>assistant\n")


def test_play_experts_follows_each_players_commands_up_to_max_turns() -> None:
    spec = WalkSpec()
    spec.expert = lambda task_id: WalkRelabeller()
    demos = list(play_experts(spec, InProcessPool(spec), ["near-1", "far-4"], max_turns=2,
                              followed=[["go to desk 1", "look"], ["look", "look", "look"]]))
    assert [len(d.steps) for d in demos] == [1, 2]  # near-1 is won at its first command; far-4 stops at 2
    assert demos[0].won and not demos[1].won


def test_an_expert_that_cannot_follow_is_refused() -> None:
    with pytest.raises(ValueError, match="WalkExpert.*cannot act from states another player reached"):
        require_relabelling_expert(WalkSpec(), "far-3")


@pytest.mark.parametrize(("overrides", "message"), [
    ([], "recipe key 'relabel.student': the alfworld expert \\(WalkthroughExpert\\) cannot act"),
    (["env.options.expert=explorer", "relabel.task_types=[pick_two_obj_and_place]"],
     "recipe key 'relabel.task_types': \\['pick_two_obj_and_place'\\] has no task in train"),
    (["env.options.expert=explorer", "relabel.split=trian"], "recipe key 'relabel.split': unknown alfworld split"),
])
def test_bad_relabelling_fails_before_any_model_or_demo_work(tmp_path: Path, overrides: list[str],
                                                             message: str) -> None:
    recipe = _write(tmp_path, {"name": "t", "env": {"name": "alfworld", "task_types": ["look_at_obj_in_light"]},
                               "model": {"path": str(tmp_path / "none")},
                               "relabel": {"student": {"path": str(tmp_path / "student")}}})
    with pytest.raises(RecipeError, match=message):
        run_sft(load_sft_recipe(str(recipe), overrides))


def test_example_batch_masks_exactly_the_answer_tokens() -> None:
    from turnopd.orchestration.sft import SFTExample

    examples = [SFTExample("a", 0, [5, 6, 7], [8, 9]), SFTExample("b", 3, [5], [10, 11, 12])]
    batch = example_batch([[ex] for ex in examples], "walk")
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 5, 10, 11, 12]
    assert batch.loss_mask.tolist() == [False, False, False, True, True, False, True, True, True]
    assert batch.seq_lens.tolist() == [5, 4]
    assert batch.turn_ids.tolist() == [-1, -1, -1, 0, 0, -1, 3, 3, 3]
    assert batch.num_trajectories == 2


def test_batches_cover_each_example_once_per_epoch() -> None:
    drawn = list(batches([1] * 10, 4, steps=5, seed=3))
    assert [len(b) for b in drawn] == [4] * 5
    flat = [i for b in drawn for i in b]
    assert sorted(flat[:10]) == list(range(10))  # the first epoch
    assert sorted(flat[10:20]) == list(range(10))  # the second
    assert drawn == list(batches([1] * 10, 4, steps=5, seed=3))
    assert drawn != list(batches([1] * 10, 4, steps=5, seed=4))


def test_batches_of_conversations_hold_at_least_batch_turns() -> None:
    sizes = [3, 1, 5, 2]  # turns per conversation
    drawn = list(batches(sizes, 4, steps=6, seed=0))
    for batch in drawn:  # a batch stops at the first conversation that reaches 4 turns
        turns = [sizes[i] for i in batch]
        assert sum(turns) >= 4 and sum(turns[:-1]) < 4
    flat = [i for b in drawn for i in b]
    assert sorted(flat[:4]) == [0, 1, 2, 3]  # each conversation once in the first epoch


def test_demo_cache_depends_on_episodes_not_on_prompt_settings() -> None:
    base = EnvConfig(name="alfworld", options={"expert": "handcoded"})
    same = EnvConfig(name="alfworld", options={"expert": "handcoded"}, history_length=0, answer_format="action")
    assert demo_cache_path(base, "train", "1") == demo_cache_path(same, "train", "1")
    assert demo_cache_path(base, "train", "1") != demo_cache_path(base, "valid_seen", "1")
    assert demo_cache_path(base, "train", "1") != demo_cache_path(EnvConfig(name="alfworld"), "train", "1")
    assert demo_cache_path(base, "train", "1") != demo_cache_path(
        EnvConfig(name="alfworld", max_turns=20, options={"expert": "handcoded"}), "train", "1")
    # a new observation text (the env spec's observation_version) is not served the old episodes
    assert demo_cache_path(base, "train", "1") != demo_cache_path(base, "train", "2")


# ---- training: the loss is the NLL of answer tokens only ------------------------------------------


def test_nll_step_loss_is_the_mean_answer_token_nll(tiny_model_dir: Path) -> None:
    from turnopd.config import LossConfig, ObjectiveConfig
    from turnopd.orchestration.sft import SFTExample
    from turnopd.trainer import Trainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Your task is to: put some pencil on desk."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    answers = ["<action>go to desk 1</action>", "<action>take pencil 1 from desk 1</action>"]
    examples = [SFTExample("t", i, list(prompt), tok.encode(a, add_special_tokens=False)) for i, a in enumerate(answers)]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    nll = []
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex.prompt_ids + ex.answer_ids])
            logp = torch.log_softmax(model(ids).logits[0], -1)
            start = len(ex.prompt_ids)
            nll += [-logp[p - 1, ids[0, p]].item() for p in range(start, ids.shape[1])]
    expected = sum(nll) / len(nll)

    trainer = Trainer(model, TrainerConfig(steps=1, lr=1e-2), ObjectiveConfig(estimator="nll"),
                      LossConfig(mode="token_mean"), total_steps=20)
    first = trainer.step(example_batch([[ex] for ex in examples], "walk"), alpha=0.0).loss
    assert first == pytest.approx(expected, rel=1e-4)
    for _ in range(15):
        last = trainer.step(example_batch([[ex] for ex in examples], "walk"), alpha=0.0).loss
    assert last < 0.5 * first


def test_train_top_layers_updates_only_the_top_blocks_and_norm(tiny_model_dir: Path) -> None:
    from turnopd.config import LossConfig, ObjectiveConfig
    from turnopd.orchestration.sft import SFTExample
    from turnopd.trainer import Trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    top, bottom, norm = model.model.layers[1], model.model.layers[0], model.model.norm
    expected = sum(p.numel() for p in top.parameters()) + sum(p.numel() for p in norm.parameters())
    assert freeze_below_top_layers(model, 1) == expected
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    example = SFTExample("t", 0, tok.encode("Your task is to: put some pencil on desk."),
                         tok.encode("<action>go to desk 1</action>", add_special_tokens=False))
    trainer = Trainer(model, TrainerConfig(steps=1, lr=1e-2), ObjectiveConfig(estimator="nll"),
                      LossConfig(mode="token_mean"), total_steps=1)
    trainer.step(example_batch([[example]], "walk"), alpha=0.0)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == {f"model.layers.1.{n}" for n, _ in top.named_parameters()} | {"model.norm.weight"}
    assert all(p.grad is None for p in [*bottom.parameters(), model.model.embed_tokens.weight])


def test_train_top_layers_beyond_the_model_is_an_error(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(RecipeError, match="train_top_layers.*2 blocks"):
        freeze_below_top_layers(model, 3)


# ---- the recipe ------------------------------------------------------------------------------------


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_recipe_defaults_follow_the_env(tmp_path: Path) -> None:
    cfg = load_sft_recipe(str(_write(tmp_path, {"name": "t", "model": {"path": "/m"}})), ["env.name=alfworld"])
    assert isinstance(cfg, SFTConfig)
    assert cfg.output_dir == "runs/teachers/alfworld"
    assert cfg.teacher_spec == "teachers/alfworld/teacher.yaml"
    assert cfg.trainer.steps == 300 and cfg.batch_turns == 32


@pytest.mark.parametrize(("overrides", "message"), [
    (["batch_turns=0"], "batch_turns"),
    (["demos.episodes=0"], "demos.episodes"),
    (["env.name=nope"], "env.name"),
    (["eval.max_tasks=0"], "eval.max_tasks"),
    (["train_top_layers=0"], "train_top_layers"),
    (["trainer.bogus=1"], "bogus"),
])
def test_bad_recipes_name_the_key(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_sft_recipe(str(_write(tmp_path, {"name": "t", "model": {"path": "/m"}})), overrides)


def test_missing_model_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="model.path"):
        load_sft_recipe(str(_write(tmp_path, {"name": "t"})))


@pytest.mark.parametrize(("overrides", "message"), [
    (["demos.split=trian"], "recipe key 'demos.split': unknown alfworld split 'trian'"),
    (["env.train_split=trian"], "recipe key 'env.train_split': unknown alfworld split 'trian'"),
    (["eval.split=valid_seen+valid_seen"], "recipe key 'eval.split': split 'valid_seen\\+valid_seen' names a split twice"),
    (["env.task_types=[look_at_obj_in_light]", "env.max_tasks=0"], "split 'train' has 0 tasks and 'valid_unseen' has 0"),
])
def test_bad_splits_fail_before_any_model_or_demo_work(tmp_path: Path, overrides: list[str], message: str) -> None:
    recipe = _write(tmp_path, {"name": "t", "env": {"name": "alfworld"}, "model": {"path": str(tmp_path / "none")}})
    with pytest.raises(RecipeError, match=message):
        run_sft(load_sft_recipe(str(recipe), overrides))


def test_shipped_sft_recipes_validate() -> None:
    recipes = sorted(Path(__file__).resolve().parents[1].glob("recipes/*/teacher_*.yaml"))
    assert any(r.name == "teacher_dagger.yaml" for r in recipes), "no recipes/<env>/teacher_*.yaml"
    for recipe in recipes:
        load_sft_recipe(str(recipe))
        assert "name" in compose(recipe)


def _tiny_trainer(model_dir: Path, steps: int):
    from turnopd.config import LossConfig, ObjectiveConfig
    from turnopd.trainer import Trainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return Trainer(model, TrainerConfig(steps=steps, lr=1e-2, lr_schedule="cosine"), ObjectiveConfig(estimator="nll"),
                   LossConfig(mode="token_mean"), total_steps=steps)


def test_a_killed_build_resumes_to_the_same_steps_and_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    """4 steps straight vs killed in step 3 with a checkpoint every 2, then rerun: the rerun restores
    steps 1-2 (their losses from the checkpoint) and trains 3-4 to the same losses and weights, since
    the optimizer, the schedule and the batch order continue where they were."""
    from types import SimpleNamespace

    from turnopd.core.checkpoint import list_checkpoints
    from turnopd.orchestration.sft import SFTCheckpoints, SFTExample, train_examples

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.encode("Your task is to: put some pencil on desk.")
    examples = [SFTExample(f"t{i}", 0, prompt, tok.encode(a, add_special_tokens=False)) for i, a in
                enumerate(["<action>go to desk 1</action>", "<action>take pencil 1 from desk 1</action>",
                           "<action>look</action>"])]
    cfg = SimpleNamespace(trainer=TrainerConfig(steps=4), batch_turns=1, seed=3, env=SimpleNamespace(name="walk"))
    straight = _tiny_trainer(tiny_model_dir, 4)
    expected = [loss for loss, _ in train_examples(straight, examples, cfg)]
    expected_weights = {k: v.clone() for k, v in straight.module.state_dict().items()}

    root = tmp_path / "teacher.checkpoints"
    checkpoints = SFTCheckpoints(root, every=2, recipe="r", tokenizer=tok)
    killed = _tiny_trainer(tiny_model_dir, 4)
    step, calls = killed.step, []

    def dies_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    killed.step = dies_in_step_3
    with pytest.raises(KeyboardInterrupt):
        train_examples(killed, examples, cfg, checkpoints=checkpoints)
    assert [p.name for p in list_checkpoints(root)] == ["step_000002"]

    resumed = _tiny_trainer(tiny_model_dir, 4)
    losses = [loss for loss, _ in train_examples(resumed, examples, cfg, checkpoints=checkpoints)]
    assert losses[:2] == expected[:2]  # read back, not retrained
    assert losses[2:] == pytest.approx(expected[2:], rel=1e-5) and losses[3] != expected[2]
    for name, value in resumed.module.state_dict().items():
        torch.testing.assert_close(value, expected_weights[name], rtol=1e-5, atol=1e-6)
    assert [p.name for p in list_checkpoints(root)] == ["step_000004"]  # the last step's; keep_last 1


def test_a_killed_builds_checkpoints_continue_only_its_own_recipe(tmp_path: Path) -> None:
    from turnopd.orchestration.sft import SFTCheckpoints

    recipe = _write(tmp_path, {"name": "t", "env": {"name": "alfworld"}, "model": {"path": "/m"},
                               "output_dir": str(tmp_path / "teacher"), "checkpoint_every": 5})
    found = SFTCheckpoints.of(load_sft_recipe(str(recipe)))
    assert found.root == tmp_path / "teacher.checkpoints" and found.every == 5
    step = found.root / "checkpoints" / "step_000005"
    step.mkdir(parents=True)
    (step / "loop_state.json").write_text('{"step": 5, "losses": []}')
    (found.root / "recipe.yaml").write_text(found.recipe)
    # what only the evaluation reads, and the checkpoint interval, may change; training may not
    SFTCheckpoints.of(load_sft_recipe(str(recipe), ["eval.max_tasks=3", "teacher_spec=null", "checkpoint_every=2"]))
    # a model preparation trains into a temporary folder: its checkpoints are the final folder's
    building = SFTCheckpoints.of(load_sft_recipe(str(recipe), [f"output_dir={tmp_path}/.teacher.x1b2"]),
                                 tmp_path / "teacher")
    assert building.root == found.root and building.recipe == found.recipe
    with pytest.raises(RecipeError, match=r"teacher.checkpoints holds the checkpoints of a killed build whose "
                                          r"recipe differs in \['batch_turns', 'trainer'\]"):
        SFTCheckpoints.of(load_sft_recipe(str(recipe), ["trainer.lr=0.5", "batch_turns=4"]))


# ---- the whole command on real ALFWorld games (slow) -------------------------------------------------


@pytest.mark.slow
def test_sft_command_end_to_end(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture) -> None:
    """A few walkthrough demonstrations, a few steps, a held-out eval and a loadable teacher spec."""
    import envs.demonstrations
    from teachers.spec import load_teacher_spec
    from turnopd.cli import main

    monkeypatch.setattr(envs.demonstrations, "DEMOS_DIR", tmp_path / "demos")
    recipe = _write(tmp_path, {
        "name": "smoke",
        "env": {"name": "alfworld", "task_types": ["pick_and_place_simple"], "answer_format": "action",
                "history_length": 1, "max_turns": 8, "num_workers": 1},
        "model": {"path": str(tiny_model_dir)},
        "demos": {"episodes": 2},
        "batch_turns": 4,
        "trainer": {"steps": 3, "lr": 1e-3},
        "policy": {"max_new_tokens": 16},
        "eval": {"split": "valid_seen", "max_tasks": 2},
        "output_dir": str(tmp_path / "teacher"),
        "teacher_spec": str(tmp_path / "spec" / "teacher.yaml"),
        "checkpoint_every": 2,
    })
    # a train_top_layers the model cannot take fails before any demonstration is played
    assert main(["sft", str(recipe), "train_top_layers=3"]) == 2
    assert "'train_top_layers': 3, but the model has 2 blocks" in capsys.readouterr().err
    assert not (tmp_path / "demos").exists()
    assert main(["sft", str(recipe)]) == 0
    summary = json.loads((tmp_path / "teacher" / "sft_summary.json").read_text())
    assert summary["demos_played"] == 2 and summary["steps"] == 3 and summary["eval_tasks"] == 2
    assert summary["examples"] > 0 and 0.0 <= summary["avg_at_1"] <= 1.0 and math.isfinite(summary["final_loss"])
    assert not (tmp_path / "teacher.checkpoints").exists()  # a complete build keeps no resumable state
    spec = load_teacher_spec(tmp_path / "spec" / "teacher.yaml")
    assert Path(spec.model) == tmp_path / "teacher" and spec.backend == "transformers"
    assert f"# Written by `turnopd sft {recipe}` (held-out Avg@1 {100 * summary['avg_at_1']:.1f}% on 2 valid_seen tasks)" \
        in Path(spec.source).read_text()
    assert AutoModelForCausalLM.from_pretrained(spec.model).config.vocab_size == len(AutoTokenizer.from_pretrained(spec.model))
    # The expert episodes are cached for the next run.
    cached = (tmp_path / "demos" / "alfworld").glob("*.jsonl")
    assert sum(len(p.read_text().splitlines()) for p in cached) == 2


@pytest.mark.slow
def test_sft_with_relabelled_student_states_end_to_end(tmp_path: Path, tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """relabel.student plays real ALFWorld games; the explorer labels its states; they join the
    expert's demonstrations (the training turns are exactly both kinds)."""
    import envs.demonstrations

    monkeypatch.setattr(envs.demonstrations, "DEMOS_DIR", tmp_path / "demos")
    recipe = _write(tmp_path, {
        "name": "dagger",
        "env": {"name": "alfworld", "task_types": ["look_at_obj_in_light"], "template": "notebook",
                "answer_format": "action", "history_length": 1, "max_turns": 6, "num_workers": 1,
                "options": {"expert": "explorer", "expert_noise": 0.15, "notes": True}},
        "model": {"path": str(tiny_model_dir)},
        "demos": {"episodes": 2},
        "relabel": {"student": {"path": str(tiny_model_dir)}, "episodes": 2, "temperature": 1.0},
        "batch_turns": 4,
        "trainer": {"steps": 2, "lr": 1e-3},
        "policy": {"max_new_tokens": 8},
        "eval": {"enabled": False},
        "output_dir": str(tmp_path / "teacher"),
        "teacher_spec": None,
    })
    summary = run_sft(load_sft_recipe(str(recipe)))
    relabel = summary.relabel
    assert relabel is not None and relabel["episodes"] == 2
    # a random-init student rarely acts at all: its episodes run to max_turns, one state per turn
    assert 2 <= relabel["states"] <= 2 * 6 and 0 < relabel["imitated"] <= relabel["states"]
    (cache,) = (tmp_path / "demos" / "alfworld").glob("*.jsonl")
    demos = [Demonstration.from_json(line) for line in cache.read_text().splitlines()]
    expert_turns = sum(step.imitate for demo in demos if demo.won for step in demo.steps)
    assert summary.examples == expert_turns + relabel["imitated"]
    assert json.loads((tmp_path / "teacher" / "sft_summary.json").read_text())["relabel"]["states"] == relabel["states"]


def test_a_chat_demonstration_trains_as_one_sequence_with_the_same_loss(smollm2_tiny_model_dir: Path) -> None:
    """prompt.style=chat: an episode's imitated turns are one sequence (its last prompt and answer),
    whose answer tokens have the NLL they have as one example a turn (causal attention, same prefix)."""
    from turnopd.config import LossConfig, ObjectiveConfig
    from turnopd.orchestration.sft import conversations
    from turnopd.trainer import Trainer

    spec = WalkSpec()
    demos = list(play_experts(spec, InProcessPool(spec), ["far-3", "near-2"], max_turns=10))
    tok = AutoTokenizer.from_pretrained(smollm2_tiny_model_dir)
    examples = demo_examples(demos, spec, EnvConfig(name="alfworld", answer_format="action"), tok,
                             prompt=PromptConfig(style="chat"))
    turns = [len(d.steps) for d in demos]
    assert len(examples) == sum(turns) and turns[0] >= 3
    assert conversations(examples) == [list(range(turns[0])), list(range(turns[0], sum(turns)))]
    # history_block prompts are fresh messages: every turn its own example
    assert conversations(demo_examples(demos, spec, EnvConfig(name="alfworld"), tok)) == [[i] for i in range(sum(turns))]

    per_turn = example_batch([[ex] for ex in examples], "walk")
    merged = example_batch([examples[: turns[0]], examples[turns[0]:]], "walk")
    last = [examples[turns[0] - 1], examples[-1]]
    assert merged.seq_lens.tolist() == [len(ex.prompt_ids) + len(ex.answer_ids) for ex in last]
    assert int(merged.loss_mask.sum()) == int(per_turn.loss_mask.sum()) == sum(len(ex.answer_ids) for ex in examples)
    assert merged.input_ids.numel() < per_turn.input_ids.numel()
    losses = []
    for batch in (per_turn, merged):
        model = AutoModelForCausalLM.from_pretrained(smollm2_tiny_model_dir, dtype=torch.float32)
        trainer = Trainer(model, TrainerConfig(steps=1, lr=1e-3), ObjectiveConfig(estimator="nll"),
                          LossConfig(mode="token_mean"), total_steps=1)
        losses.append(trainer.step(batch, alpha=0.0).loss)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
