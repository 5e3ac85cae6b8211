"""Recipes checked against every registry: the schema and rules of turnopd.config, plus the keys that
name a backend (env, policy backend, model preparation, pipeline mode) and the rules that need one.

    cfg = load_recipe("recipes/quickstart.yaml", ["trainer.steps=10"])

Every choice a recipe can name is listed by its registry, so a value that validates is one that
exists; the pre-flight checks (turnopd.orchestration.preflight) then check what needs the teacher
specs (an in-process teacher for `full`, a top-k the teacher can score for `topk`, an installed vLLM).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from envs import ENVS, make_env_spec
from envs.base import EnvSettingError, shows_screenshots
from turnopd.algorithm.objective import ESTIMATORS
from turnopd.config import (
    EnvConfig,
    RecipeError,
    RunConfig,
    check_consistency,
    compose,
    env_mixture,
    validate,
)
from turnopd.core.data import REPO_ROOT, DataNotFoundError
from turnopd.core.registry import Registry
from turnopd.models import MODEL_PREPARERS
from turnopd.models.smollm2 import smollm2_tokenizer
from turnopd.orchestration.pipeline import PIPELINE_MODES
from turnopd.rollout import POLICY_BACKENDS
from turnopd.rollout.chat import require_tools

# The backend registries that recipe keys name, by kind (config's `registry` field metadata). The
# `sft` model preparation is registered by turnopd.orchestration.sft, which the package imports first.
BACKEND_REGISTRIES: dict[str, Registry] = {r.kind: r for r in (ENVS, POLICY_BACKENDS, MODEL_PREPARERS, PIPELINE_MODES)}


def check_env(cfg: Any) -> None:
    """The env's own checks of its block (task types, options, template) and of its data, run when the
    recipe is checked: its message, on one line, instead of a traceback at start-up. A multi-env run's
    envs each (their keys named envs.<name>.*)."""
    mixed = isinstance(cfg, RunConfig) and bool(cfg.envs)
    for env in [share.env for share in env_mixture(cfg)] if mixed else [cfg.env]:
        block = f"envs.{env.name}" if mixed else "env"
        try:
            make_env_spec(env, cfg.data_dir)
        except DataNotFoundError as exc:
            raise RecipeError(f"recipe key 'data_dir': {' '.join(str(exc).split())}") from None
        except (ValueError, FileNotFoundError, KeyError, ImportError) as exc:
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            key = f"'{block}.{exc.key}'" if isinstance(exc, EnvSettingError) else f"'{block}' (env {env.name})"
            raise RecipeError(f"recipe key {key}: {' '.join(str(message).split())}") from None


def check_pipeline(cfg: RunConfig) -> None:
    """An off-policy pipeline trains on tokens sampled by older weights: an estimator with an
    importance ratio then needs its clip."""
    mode, est = PIPELINE_MODES.get(cfg.pipeline.mode), ESTIMATORS.get(cfg.objective.estimator)
    if cfg.depth.probe_fraction is not None and mode.off_policy:
        raise RecipeError(f"recipe key 'depth.probe_fraction': {cfg.depth.probe_fraction} with pipeline.mode="
                          f"{cfg.pipeline.mode}: continuous probes play in every step's batch with the step's own "
                          "weights, which only pipeline.mode=sync gives; use periodic probes (probe_fraction: null)")
    if mode.off_policy and est.needs_sampling_logprobs and cfg.objective.clip_eps is None:
        raise RecipeError(f"recipe key 'objective.clip_eps': None; pipeline.mode={cfg.pipeline.mode} trains on "
                          f"tokens sampled by older weights, so the {est.name} importance ratio needs a clip (e.g. 0.2)")


def check_judge(cfg: RunConfig) -> None:
    """A judge reads metrics from the env's observations: its memory (the attempts' results) and a world
    model's predictions need an env that reports one (envs.base.MetricReader)."""
    needs_metric = cfg.judge.memory != "none" or cfg.judge.by == "world_model"
    if needs_metric and not hasattr(ENVS.get(cfg.env.name), "read_metric"):
        raise RecipeError(f"recipe key 'judge': by={cfg.judge.by}, memory={cfg.judge.memory} reads each step's metric "
                          f"from the observations, and env {cfg.env.name!r} reports none (no read_metric); use "
                          "judge.by=teacher with judge.memory=none, or an env with a metric (autoresearch)")


def check_screenshots(cfg: RunConfig) -> None:
    """An env that shows screenshots runs what passes screenshot keys through: the transformers policy
    (it fetches the images of a generation batch; any backend when the student reads the screens as
    text through student.screen_reader, which only such an env takes), a teacher that scores from the batch (the
    in-process full estimator would read the student's image tokens, not the teacher's text), no judge
    and no world model (their prompts have no images); a multi-env run none (its pixel store and the
    student's screenshots are one env's). Every pipeline mode: the asynchronous ones free a step's
    screenshots keeping those the generator's episodes hold (pipeline.generator.held_screens)."""
    screenshots = [env for env in cfg.envs if shows_screenshots(ENVS.get(env))]
    if screenshots:
        raise RecipeError(f"recipe key 'envs': env {screenshots[0]!r} shows screenshots; a multi-env run plays "
                          "text envs (its pixel store and the student's screenshots are one env's)")
    reader = cfg.student.screen_reader
    check_screen_reader(cfg.student, "student", cfg.env.name)
    if not shows_screenshots(ENVS.get(cfg.env.name)):
        return
    why = {"policy.backend": (cfg.policy.backend != "transformers" and reader is None,
                              "only the transformers policy takes images (a student with student.screen_reader "
                              "reads text, in any backend)"),
           "objective.tokenizers": (cfg.objective.tokenizers == "cross" and reader is not None,
                                    "a teacher of another tokenizer with a screen-reading student is not built"),
           "objective.estimator": (ESTIMATORS.get(cfg.objective.estimator).needs_teacher_model,
                                   "the in-process teacher would read the student's image tokens; use k1, k3 or "
                                   "topk (the teacher scores its own text prompt)"),
           "judge.by": (cfg.judge.by != "none", "a judge's prompts have no images"),
           "world_model.path": (cfg.world_model.path is not None, "a world model's prompts have no images")}
    for key, (refused, reason) in why.items():
        if refused:
            raise RecipeError(f"recipe key {key!r}: {OmegaConf.select(OmegaConf.structured(cfg), key)} with env "
                              f"{cfg.env.name!r}, which shows screenshots: {reason}")


def check_screen_reader(model: Any, key: str, env: str) -> None:
    """A model block's screen_reader reads screenshots: its env must show them."""
    if model.screen_reader is not None and not shows_screenshots(ENVS.get(env)):
        raise RecipeError(f"recipe key '{key}.screen_reader': {model.screen_reader} with env {env!r}, which shows no "
                          "screenshots to read; use an env that shows them (webshop_screenshot) or null")


def check_prompt_tools(cfg: RunConfig) -> None:
    """prompt.tools needs a chat template that shows tools: checked here when the student's tokenizer can
    be found before it is built (else when its renderer is built, before the first episode)."""
    tokenizer = cfg.prompt.tools and model_tokenizer(cfg.student)
    if tokenizer:
        require_tools(tokenizer)


def model_tokenizer(model: Any) -> Any:
    """The tokenizer of a recipe's model block (path, prepare, prepare_options), found without building
    it: its folder's; SmolLM2's for the smollm2-135m preparation; for an `sft` preparation, that of
    the model its SFT recipe fine-tunes. None: not known before the build."""
    from transformers import AutoTokenizer

    folder = Path(model.path).expanduser()
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    if model.prepare == "smollm2-135m":
        return smollm2_tokenizer()
    recipe = REPO_ROOT / str(model.prepare_options.get("recipe", "")) if model.prepare == "sft" else None
    return model_tokenizer(compose(recipe).model) if recipe is not None and recipe.is_file() else None


def validate_recipe(cfg: DictConfig, schema: type = RunConfig,
                    checks: Sequence[Callable[[Any], None]] = (check_consistency, check_env, check_pipeline,
                                                                check_judge, check_screenshots, check_prompt_tools)) -> Any:
    """turnopd.config.validate with every backend registry (for any schema: RunConfig, the SFT
    recipe, an env block)."""
    return validate(cfg, schema, checks, BACKEND_REGISTRIES)


def load_recipe(recipe: str | os.PathLike[str], overrides: Sequence[str] = ()) -> RunConfig:
    """Compose, validate and return a distillation recipe as a RunConfig."""
    return validate_recipe(compose(recipe, overrides))


def load_env_config(overrides: DictConfig) -> EnvConfig:
    """An `env` block on its own (turnopd env ...), validated like a recipe's."""
    return validate_recipe(overrides, schema=EnvConfig, checks=())
