"""Recipes: composition, overrides and the errors that name key, value and what is allowed."""

from pathlib import Path

import pytest

from turnopd.cli import main
from turnopd.config import RecipeError, RunConfig, Section, check_consistency
from turnopd.orchestration.recipe import load_recipe

BASE = """
name: base-run
student: {path: /models/student}
teachers: {alfworld: teachers/alfworld/teacher.yaml}
env: {name: alfworld, max_turns: 50}
trainer: {steps: 20, lr: 1.0e-5}
"""


@pytest.fixture
def recipes(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "child.yaml").write_text("defaults: [base.yaml]\nname: child\nloss: {mode: turn}\n")
    (tmp_path / "grandchild.yaml").write_text("defaults: child.yaml\ntrainer: {steps: 7}\n")
    return tmp_path


def test_defaults_compose_in_order_then_overrides(recipes):
    cfg = load_recipe(recipes / "grandchild.yaml", ["env.max_turns=30", "seed=3"])
    assert cfg.name == "child"  # from child, over base
    assert cfg.loss.mode == "turn"
    assert cfg.trainer.steps == 7 and cfg.trainer.lr == 1e-5  # grandchild over base, base kept
    assert cfg.env.max_turns == 30 and cfg.seed == 3
    assert cfg.depth.ema == 0.3 and cfg.depth.h_min == 2  # paper defaults


@pytest.mark.parametrize("override, message", [
    (["trainer.stepz=3"], "recipe key 'trainer.stepz'"),
    (["trainer.steps=abc"], "recipe key 'trainer.steps'"),
    (["loss.mode=tokenwise"], "recipe key 'loss.mode': 'tokenwise' is not allowed; allowed: constant, "
                              "constant_token_mean, progressive, sequence, token, token_mean, trajectory, turn, "
                              "turn_row_mean"),
    (["objective.estimator=k2"], "allowed: full, k1, k1_decoupled, k1_proximal, k3, nll, topk"),
    (["student.prepare=tinyy"], "recipe key 'student.prepare': 'tinyy' is not allowed; allowed: screen_reader, sft, smollm2-135m, tiny"),
    (["policy.backend=sglang"], "recipe key 'policy.backend': 'sglang' is not allowed; allowed: transformers, vllm"),
    (["pipeline.mode=async"], "recipe key 'pipeline.mode': 'async' is not allowed; allowed: one_step_off, pool, sync"),
    (["depth.ema=1.5"], "recipe key 'depth.ema': 1.5 is out of range [0.0, 1.0]"),
    (["env.name=minecraft"], "recipe key 'env.name': 'minecraft' is not allowed; allowed: alfworld"),
    (["depth.mode=fixed"], "depth.mode=fixed needs 1 <= fixed_cap <= env.max_turns=50"),
    (["depth.mode=fixed", "depth.fixed_cap=51"], "depth.mode=fixed needs 1 <= fixed_cap <= env.max_turns=50"),
    (["depth.h_max=60"], "recipe key 'depth.h_max': removed; the horizon is one setting, env.max_turns"),
    (["depth.h_min=51"], "'depth.h_min'=51 exceeds the horizon 'env.max_turns'=50"),
    (["depth.ema=0"], "'depth.ema': 0 would never move the cap"),
    (["depth.coverage_fallback=last"], "recipe key 'depth.coverage_fallback': 'last' is not allowed; allowed: "
                                       "previous, h_max, h_eff"),
    (["loss.alpha_start=0.5", "loss.alpha_end=0.5"], "need alpha_end > alpha_start"),
    (["trainer.budget.unit=gpu_hours", "trainer.budget.amount=1"], "recipe key 'trainer.budget.unit': 'gpu_hours' is "
                                                                  "not allowed; allowed: train_time_s, env_steps, "
                                                                  "tokens_generated, tokens_trained"),
    (["trainer.budget.unit=env_steps"], "recipe key 'trainer.budget.amount': 0.0; a budget of env_steps needs an "
                                        "amount > 0"),
    (["trainer.budget.amount=-5"], "recipe key 'trainer.budget.amount': -5.0"),
    (["env.step_latency_s=-1"], "recipe key 'env.step_latency_s': -1.0 is out of range [0.0, inf]"),
    (["env.step_latency_s=60"], "'env.step_latency_s'=60.0 must be below 'env.step_timeout_s'=60.0"),
    (["world_model.path=/wm", "pipeline.mode=pool"], "'world_model.path' with pipeline.mode=pool: world-model "
                                                     "rollouts play in the training process"),
    (["world_model.path=/wm", "world_model.real_fraction=0"], "'world_model.real_fraction': 0 leaves no real"),
    (["world_model.real_fraction=1.5"], "recipe key 'world_model.real_fraction': 1.5 is out of range [0.0, 1.0]"),
    (["world_model.samples=0"], "recipe key 'world_model.samples': 0 is out of range"),
    (["world_model.verdict=final"], "recipe key 'world_model.verdict': 'final' is not allowed; allowed: last_turn, "
                                    "replay"),
    (["world_model.debias=affine"], "recipe key 'world_model.debias': 'affine' is not allowed; allowed: ppi, isotonic"),
    (["world_model.denoise=none"], "recipe key 'world_model.denoise': 'none' is not allowed; allowed: "
                                   "trajectory_variance, anchor_weight"),
    (["world_model.anchor_fraction=2"], "recipe key 'world_model.anchor_fraction': 2.0 is out of range [0.0, 1.0]"),
    (["world_model.path=/wm", "world_model.denoise=anchor_weight"],
     "recipe key 'world_model.denoise': 'anchor_weight' measures the world model's disagreement within a group"),
    (["world_model.path=/wm", "world_model.debias=isotonic", "world_model.anchor_fraction=0",
      "world_model.anchor_min_groups=0"], "recipe key 'world_model.anchor_fraction': 0 with anchor_min_groups=0"),
    (["trainer.group_size=3"], "recipe key 'trainer.group_size': 3 does not divide trainer.episodes_per_step=16"),
    (["objective.reward_weight=0.5"], "recipe key 'objective.reward_weight': 0.5 with trainer.group_size=1"),
    (["objective.reward_weight=-1"], "recipe key 'objective.reward_weight': -1.0 is out of range [0.0, inf]"),
    (["objective.advantage=ppo"], "recipe key 'objective.advantage': 'ppo' is not allowed; allowed: grpo"),
    (["objective.reward_weight=0.5", "trainer.group_size=2", "objective.estimator=full"],
     "recipe key 'objective.reward_weight': 0.5 with estimator full, which reads hidden states"),
    (["loss.mode=constant"], "loss.mode=constant needs constant_k > 0"),
    (["env.name=webshop", "env.max_turns=15"], "no teacher for env 'webshop'"),
    (["judge.memory=full"], "recipe key 'judge.memory': 'full' with judge.by=none"),
    (["familiarity.mode=gate"], "recipe key 'familiarity.threshold': familiarity.mode=gate needs a threshold"),
    (["student.lora.target_modules=[lm_head]"], "recipe key 'student.lora.target_modules': ['lm_head']"),
    (["prompt.style=messages"], "recipe key 'prompt.style': 'messages' is not allowed; allowed: history_block, chat"),
    (["prompt.tools=true"], "recipe key 'prompt.tools': True needs prompt.style=chat"),
    (["prompt.system=hello"], "recipe key 'prompt.system': 'hello' needs prompt.style=chat"),
    (["prompt.style=chat", "prompt.max_context=128"], "recipe key 'prompt.max_context': 128 leaves no room for a "
                                                      "prompt beside policy.max_new_tokens=128"),
    (["prompt.style=chat", "prompt.max_context=0"], "recipe key 'prompt.max_context': 0 is out of range"),
    (["prompt.style=chat", "judge.by=teacher"], "recipe key 'prompt.style': chat with a world model or a judge"),
    (["trainer.steps"], "overrides must be key=value"),
    # a value, or a list, where a section is expected (and a mapping where a list is): the key is named
    (["student=Qwen/Qwen3-1.7B"], "recipe key 'student': 'Qwen/Qwen3-1.7B' is a value, and 'student' is a section "
                                  "of keys (path, dtype, prepare, prepare_options, screen_reader, lora); set one of them, e.g. "
                                  "student.path=Qwen/Qwen3-1.7B"),
    (["depth=3"], "recipe key 'depth': 3 is a value, and 'depth' is a section of keys (mode,"),
    (["trainer.budget=3"], "recipe key 'trainer.budget': 3 is a value, and 'trainer.budget' is a section of keys "
                           "(unit, amount)"),
    (["student=[a,b]"], "recipe key 'student': override 'student=[a,b]' gives a list where the recipe has a section"),
    (["tracking={wandb: 1}"], "recipe key 'tracking': a mapping where a list is expected, e.g. tracking=[a,b]"),
])
def test_bad_values_name_the_key(recipes, override, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(recipes / "base.yaml", override)
    assert message in str(err.value)


def test_missing_required_key(tmp_path):
    (tmp_path / "r.yaml").write_text("teachers: {alfworld: t.yaml}\n")
    with pytest.raises(RecipeError, match="missing a value: name, student.path"):
        load_recipe(tmp_path / "r.yaml")


def test_defaults_cycle_and_missing_file(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: [b.yaml]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a.yaml]\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_cli_show_and_errors(recipes, capsys):
    assert main(["show", str(recipes / "child.yaml"), "trainer.steps=5"]) == 0
    out = capsys.readouterr().out
    assert "name: child" in out and "steps: 5" in out and "mode: turn" in out
    assert main(["show", str(recipes / "child.yaml"), "loss.mode=bad"]) == 2
    assert "recipe key 'loss.mode': 'bad' is not allowed" in capsys.readouterr().err


@pytest.mark.parametrize("unit", ["train_time_s", "env_steps", "tokens_generated", "tokens_trained"])
def test_a_training_budget_in_each_unit_validates(recipes, unit):
    cfg = load_recipe(recipes / "base.yaml", [f"trainer.budget.unit={unit}", "trainer.budget.amount=1500"])
    assert (cfg.trainer.budget.unit, cfg.trainer.budget.amount) == (unit, 1500.0)
    assert load_recipe(recipes / "base.yaml").trainer.budget is None  # by default: all trainer.steps


def test_check_consistency_runs_every_sections_rules(recipes, monkeypatch):
    """Each section checks its own rules (Section.check); check_consistency runs them all, the
    recipe's top-level keys last."""
    cfg = load_recipe(recipes / "base.yaml")
    checked = []
    for section in cfg.sections():
        monkeypatch.setattr(type(section), "check", lambda self, run: checked.append(type(self).__name__))
    check_consistency(cfg)
    sections = {type(value).__name__ for value in vars(cfg).values() if isinstance(value, Section)}
    assert sorted(checked[:-1]) == sorted(sections) and checked[-1] == "RunConfig"  # each once, the run's keys last
    assert {"EnvConfig", "StudentConfig", "ObjectiveConfig", "LossConfig", "FamiliarityConfig", "DepthConfig",
            "TrainerConfig", "WorldModelRolloutConfig", "JudgeConfig"} <= sections
    assert isinstance(cfg, RunConfig)


def test_the_smollm2_chat_recipe_shows_and_refuses_by_key(capsys, smollm2_tokenizer_dir):
    """`turnopd show` on the SmolLM2 chat recipe: it validates; a bad style is refused by its key, and
    so are tools, found before any model is built: the student's SFT recipe fine-tunes SmolLM2, whose
    ChatML template has no tool calling."""
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "alfworld" / "smollm2_chat.yaml")
    assert main(["show", recipe, "prompt.style=chat"]) == 0
    assert "style: chat" in capsys.readouterr().out
    assert main(["show", recipe, "prompt.style=conversation"]) == 2
    assert "recipe key 'prompt.style': 'conversation' is not allowed; allowed: history_block, chat" in \
        capsys.readouterr().err
    assert main(["show", recipe, "prompt.tools=true"]) == 2
    assert "recipe key 'prompt.tools': the chat template of" in capsys.readouterr().err


def test_tools_are_refused_for_a_student_whose_template_has_none(recipes, smollm2_tiny_model_dir):
    """SmolLM2's ChatML template ignores tools=: refused at recipe check, by the key."""
    chat = [f"student.path={smollm2_tiny_model_dir}", "prompt.style=chat"]
    assert load_recipe(recipes / "base.yaml", chat).prompt.style == "chat"
    with pytest.raises(RecipeError, match=r"recipe key 'prompt.tools': the chat template of .* ignores tools="):
        load_recipe(recipes / "base.yaml", [*chat, "prompt.tools=true"])
