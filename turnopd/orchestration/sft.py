"""Teachers by supervised fine-tuning: a model trained on an env's expert demonstrations.

    turnopd sft recipes/alfworld/teacher_sft.yaml [key=value ...]

1. Demonstrations: the env's expert plays `demos.episodes` train tasks (round-robin over task types)
   through the env pool. Episodes are cached as JSON lines under ~/.cache/turnopd/demos, keyed by
   env, split, max_turns and env options (the expert is one of them), so reruns and other prompt
   settings reuse them; only the won ones are trained on.
2. Each demonstration turn is rendered exactly as the student sees that turn in a rollout (the env's
   prompt template with the same history window, admissible actions and answer format, as ONE
   chat user message), and the answer is `format_answer(action, env.answer_format)`.
   With `relabel.student` set (DAgger-style, to make the teacher familiar with where students go),
   that student also plays `relabel.episodes` train tasks at full depth (sampled at
   `relabel.temperature`), and the env replays each episode while its expert labels every state the
   student reached (envs.demonstrations.relabel_episodes); each state where the expert's command is
   admissible becomes a training turn: the student's prompt there, the expert's answer.
3. Training: the same DeepSpeed trainer as distillation, objective `nll` with `token_mean` loss, so
   the loss is the mean negative log-likelihood of the answer tokens only (prompts are context).
   `train_top_layers: N` trains only the last N transformer blocks and the final norm of a
   pretrained model (its embeddings and lower blocks frozen): the backward pass stops at block -N,
   which makes a step of SmolLM2-135M ~3x faster on CPU.
   With `checkpoint_every: N` the trainer's state is saved every N steps beside the output folder
   (`<output_dir>.checkpoints/`, removed when the build completes); running the same recipe again
   after a kill resumes there, and a changed recipe is refused (a long build spread over sittings).
4. Output: the model in Hugging Face format with its tokenizer in `output_dir`, its held-out Avg@1
   (greedy) in sft_summary.json, and a teacher spec (`teacher_spec`) that distillation recipes name.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from envs import make_env_spec
from envs.base import EnvSpec, recent_pairs, shows_screenshots, split_tasks
from envs.demonstrations import (
    Demonstration,
    collect_demonstrations,
    demo_contexts,
    demo_tasks,
    relabel_episodes,
    require_relabelling_expert,
)
from envs.pool import EnvPool
from teachers.spec import TeacherSpec, save_teacher_spec
from turnopd.config import (
    EnvConfig,
    LossConfig,
    ModelConfig,
    ObjectiveConfig,
    PolicyConfig,
    PromptConfig,
    RecipeError,
    TrainerConfig,
    compose,
    differing_keys,
)
from turnopd.core import checkpoint as ckpt
from turnopd.core.data import REPO_ROOT
from turnopd.core.progress import EpisodeProgress, progress_bar
from turnopd.core.types import Trajectory, Turn, build_token_batch
from turnopd.loaders.hf_models import (
    image_tokens_of,
    is_vision_language,
    load_model,
    model_positions,
    resolve_dtype,
)
from turnopd.loaders.screens import attach_screens
from turnopd.models import MODEL_PREPARERS, building, prepare_model
from turnopd.models.screen_reader import reader_for
from turnopd.orchestration.preflight import train_and_eval_tasks
from turnopd.orchestration.recipe import check_env, check_screen_reader, validate_recipe
from turnopd.rollout import SamplingParams, make_policy
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.eval import EvalResult, evaluate
from turnopd.rollout.render import renderer_for

RELABEL_SALT = 5_555  # the relabelled student's task draw, apart from the demonstrations'

# ---------------------------------------------------------------------------------------------
# Recipe
# ---------------------------------------------------------------------------------------------


@dataclass
class DemoConfig:
    split: str | None = None  # None: env.train_split
    episodes: int = field(default=100, metadata={"range": (1, None)})  # expert episodes to play


@dataclass
class RelabelConfig:
    """DAgger-style states (see the module docstring); null student: expert demonstrations only."""

    student: ModelConfig | None = None  # the model whose states are relabelled (built by its `prepare` if missing)
    episodes: int = field(default=64, metadata={"range": (1, None)})
    temperature: float = field(default=0.5, metadata={"range": (0.0, None)})  # the student's sampling
    split: str | None = None  # None: demos.split
    task_types: list[str] | None = None  # None: env.task_types (e.g. only the types students are distilled on)


@dataclass
class SFTEvalConfig:
    enabled: bool = True  # False: skip the held-out evaluation (a model built as a preparation)
    split: str | None = None  # None: env.eval_split
    max_tasks: int | None = None  # first N tasks of the split (after env.task_types), None: all


@dataclass
class SFTConfig:
    """A `turnopd sft` recipe. `trainer.steps` optimizer steps of `batch_turns` demonstration turns;
    `policy` sets the greedy held-out evaluation's generation (stop strings, max_new_tokens)."""

    name: str = MISSING
    seed: int = 0
    data_dir: str | None = None
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)  # the model to fine-tune
    demos: DemoConfig = field(default_factory=DemoConfig)
    relabel: RelabelConfig = field(default_factory=RelabelConfig)
    batch_turns: int = field(default=32, metadata={"range": (1, None)})
    train_top_layers: int | None = field(default=None, metadata={"range": (1, None)})  # None: every parameter
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(steps=300, lr=1e-3))
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)  # how a turn is shown, as in distillation
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)
    output_dir: str = "runs/teachers/${env.name}"  # the teacher checkpoint (HF format)
    teacher_spec: str | None = "teachers/${env.name}/teacher.yaml"  # None: write no spec
    # optimizer steps between resumable checkpoints (0: none): a killed build rerun with the same
    # recipe continues from the newest (SFTCheckpoints)
    checkpoint_every: int = field(default=0, metadata={"range": (0, None)})


def _check_sft(cfg: SFTConfig) -> None:
    cfg.prompt.check_keys(cfg.policy.max_new_tokens)
    check_screen_reader(cfg.model, "model", cfg.env.name)
    if cfg.eval.max_tasks is not None and cfg.eval.max_tasks < 1:
        raise RecipeError(f"recipe key 'eval.max_tasks': {cfg.eval.max_tasks}; need >= 1 or null (all tasks)")


def load_sft_recipe(recipe: str, overrides: list[str] | tuple[str, ...] = ()) -> SFTConfig:
    return validate_recipe(compose(recipe, overrides), schema=SFTConfig, checks=[check_env, _check_sft])


# ---------------------------------------------------------------------------------------------
# Demonstrations as training examples
# ---------------------------------------------------------------------------------------------


@dataclass
class SFTExample:
    """One demonstration turn: the prompt the student would see and the expert's answer tokens."""

    task_id: str
    turn: int
    prompt_ids: list[int]
    answer_ids: list[int]
    image_keys: list[str] = field(default_factory=list)  # the prompt's screenshots (an env that shows them)


def demo_examples(demos: list[Demonstration], spec: EnvSpec, env_config: EnvConfig, tokenizer: Any,
                  image_tokens: int = 0, prompt: PromptConfig | None = None, screen_reader: Any = None
                  ) -> list[SFTExample]:
    """Every imitated turn of the won demonstrations (not an exploring expert's mistakes) and of the
    relabelled episodes (won or not: the expert's label is the answer), rendered by the rollout
    engine's renderer (turnopd.rollout.render.renderer_for, under the recipe's `prompt` section: in a
    chat, turn t's prompt holds the episode's earlier turns as played; in an env that shows
    screenshots, its pages drawn again into the pixel store and shown to a student of `image_tokens`
    positions an image, or as the text its `screen_reader` reads)."""
    renderer = renderer_for(spec, tokenizer, image_tokens=image_tokens, screen_reader=screen_reader, prompt=prompt)
    examples = []
    for demo in (d for d in demos if d.won or d.relabelled):
        page_keys = [spec.put_screenshot(step.observation, step.admissible) for step in demo.steps] \
            if shows_screenshots(spec) else [""] * len(demo.steps)
        turns: list[Turn] = []  # the episode as played (exploring mistakes and the student's actions included)
        for ctx, step in demo_contexts(demo, env_config):
            keys = [*recent_pairs(page_keys[: ctx.step], env_config.history_length), page_keys[ctx.step]]
            shown = renderer.render(ctx, [{"screenshot": key} for key in keys], turns)
            assert shown is not None  # a renderer without a context bound shows every turn
            if step.imitate:
                answer = renderer.format_answer(step.target, env_config.answer_format)
                parsed = renderer.parse_action(answer)
                if not parsed.valid or parsed.action != step.target:  # the engine's history holds parsed actions
                    raise ValueError(f"{spec.name}: the expert's action {step.target!r} does not survive its own "
                                     f"answer format ({answer!r} parses to {parsed.action!r})")
                examples.append(SFTExample(demo.task_id, ctx.step, shown.ids,
                                           tokenizer.encode(answer, add_special_tokens=False), shown.image_keys))
            played = tokenizer.encode(renderer.format_answer(step.action, env_config.answer_format),
                                      add_special_tokens=False)
            turns.append(Turn(index=ctx.step, observation=ctx.observation, prompt_ids=shown.ids, action_ids=played,
                              student_logprobs=[0.0] * len(played)))
    return examples


def conversations(examples: list[SFTExample]) -> list[list[int]]:
    """The examples trained as one sequence, as lists of indices: consecutive turns of an episode whose
    prompt extends the previous turn's prompt and answer (a chat that only appends, prompt.style=chat)
    form one, so an episode costs one pass over its T turns' tokens where an example a turn would
    repeat the conversation T times; every other example is its own. Causal attention gives each
    answer token the same prefix either way, so the loss is the same."""
    groups: list[list[int]] = []
    for i, ex in enumerate(examples):
        if groups:
            last = examples[groups[-1][-1]]
            seen = last.prompt_ids + last.answer_ids
            if ex.task_id == last.task_id and len(ex.prompt_ids) > len(seen) and ex.prompt_ids[: len(seen)] == seen:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def example_batch(groups: list[list[SFTExample]], env_name: str):
    """A TokenBatch whose action tokens are the answers, each group of examples one trajectory (a
    group from `conversations` merges into one sequence: turnopd.core.types.trajectory_sequences)."""
    return build_token_batch([
        Trajectory(task_id=group[0].task_id, env_name=env_name, turns=[Turn(
            index=ex.turn, observation="", prompt_ids=ex.prompt_ids, action_ids=ex.answer_ids,
            student_logprobs=[0.0] * len(ex.answer_ids), image_keys=ex.image_keys) for ex in group])
        for group in groups
    ])


def batches(sizes: list[int], batch_turns: int, steps: int, seed: int) -> Iterator[list[int]]:
    """`steps` batches of group indices (`sizes`: each group's turns), each holding at least
    `batch_turns` turns (exactly that many when every group is one turn): shuffled epochs, each group
    once per epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        batch: list[int] = []
        while sum(sizes[i] for i in batch) < batch_turns:
            if not order:
                order = list(range(len(sizes)))
                rng.shuffle(order)
            batch.append(order.pop(0))
        yield batch


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class SFTResult:
    output_dir: str
    teacher_spec: str | None
    demos_played: int
    demos_won: int
    examples: int
    answer_tokens: int
    steps: int
    train_time_s: float
    first_loss: float
    final_loss: float  # mean of the last 10 steps
    eval_split: str
    eval_tasks: int
    avg_at_1: float
    per_type: dict[str, float]
    eval_mean_turns: float
    eval_time_s: float
    prepare_time_s: float  # building the model (if missing) and playing the demonstrations (if not cached)
    wall_time_s: float
    # relabel.student's states (relabel_student_states): episodes, student_success, states, imitated,
    # agreement (share of the imitated states where the student did what the expert says), seconds
    relabel: dict[str, Any] | None = None


def run_sft(cfg: SFTConfig, recipe: str | None = None, final_dir: Path | None = None) -> SFTResult:
    """Demonstrations -> fine-tuned teacher -> held-out Avg@1 -> teacher spec. `recipe` (the file cfg
    came from) goes into the spec as its `sft_recipe`, so a checkout without the model rebuilds it.
    `final_dir`: where the model ends up when cfg.output_dir is a temporary folder (prepare_sft),
    so that a killed build's checkpoints are found beside it the next time."""
    import torch
    from transformers import AutoTokenizer

    from turnopd.trainer import Trainer

    wall_start = time.perf_counter()
    checkpoints = SFTCheckpoints.of(cfg, final_dir)  # a changed recipe over a killed build's checkpoints fails here
    spec = make_env_spec(cfg.env, cfg.data_dir)
    split, train_tasks, eval_split, eval_tasks = train_and_eval_tasks(
        spec, cfg.env, eval_split=cfg.eval.split, max_eval_tasks=cfg.eval.max_tasks,
        train_split=cfg.demos.split, train_key="demos.split")
    relabel_tasks = relabel_task_ids(cfg, spec, split) if cfg.relabel.student is not None else []
    # one figure for both: a tiny model's tokenizer is trained on the same expert episodes, so
    # preparing it plays the demonstrations and collect_demonstrations reads them from the cache
    prepare_start = time.perf_counter()
    model_dir = ensure_model(cfg.model, "model")
    model = load_sft_model(model_dir, cfg.train_top_layers)  # a bad top-layer count fails before the demos play
    demos = collect_demonstrations(spec, cfg.env, split, cfg.demos.episodes, cfg.seed)
    prepare_time = time.perf_counter() - prepare_start
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples, relabel = training_examples(cfg, spec, demos, relabel_tasks, tokenizer, model.config)

    torch.manual_seed(cfg.seed)
    trainer = Trainer(model, cfg.trainer, ObjectiveConfig(estimator="nll"), LossConfig(mode="token_mean"),
                      total_steps=cfg.trainer.steps)
    trainer.images = attach_screens(spec, model_dir, reader=reader_for(cfg.model))  # a VLM's pixels (a reader's: none)
    losses = train_examples(trainer, examples, cfg, checkpoints=checkpoints.with_tokenizer(tokenizer))

    output = Path(cfg.output_dir).expanduser()
    save_model(trainer, tokenizer, output, model_dir)
    del trainer, model

    # the held-out eval and the teacher spec use the dtype it is trained in (bf16 is ~2x faster on a CPU with AMX)
    dtype = str(resolve_dtype(cfg.trainer.dtype)).removeprefix("torch.")
    eval_start = time.perf_counter()
    result = evaluate_sft_model(cfg, spec, output, dtype, eval_tasks, eval_split) if cfg.eval.enabled else None
    avg_at_1, per_type, mean_turns = (result.avg_at_k, result.per_type, result.mean_turns) if result else (
        float("nan"), {}, float("nan"))
    eval_time = time.perf_counter() - eval_start

    held_out = held_out_line(result, len(eval_tasks), eval_split)
    spec_path = _write_teacher_spec(cfg, output, tokenizer, recipe, dtype, held_out) if cfg.teacher_spec else None
    final = [loss for loss, _ in losses[-10:]]
    summary = SFTResult(
        output_dir=str(output), teacher_spec=str(spec_path) if spec_path else None, demos_played=len(demos),
        demos_won=sum(d.won for d in demos), examples=len(examples),
        answer_tokens=sum(len(ex.answer_ids) for ex in examples), steps=len(losses),
        train_time_s=sum(t for _, t in losses),
        first_loss=losses[0][0], final_loss=sum(final) / len(final), eval_split=eval_split, eval_tasks=len(eval_tasks),
        avg_at_1=avg_at_1, per_type=per_type, eval_mean_turns=mean_turns, eval_time_s=eval_time,
        prepare_time_s=prepare_time, wall_time_s=time.perf_counter() - wall_start, relabel=relabel)
    (output / "sft_summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    checkpoints.remove()  # the build is complete: its output folder is what a rerun would redo
    print_sft_summary(cfg, summary)
    return summary


def held_out_line(result: EvalResult | None, tasks: int, split: str) -> str:
    """What the teacher spec's comment says of the held-out evaluation."""
    if result is None:
        return "not evaluated"
    line = f"held-out Avg@1 {100 * result.avg_at_k:.1f}% on {tasks} {split} tasks"
    return line + (f", {result.env_failures} of them ended by env errors" if result.env_failures else "")


def load_sft_model(model_dir: Path, train_top_layers: int | None) -> Any:
    """The model to fine-tune (a vision-language one whole, vision tower included), in fp32 master
    weights, frozen below its top `train_top_layers` blocks when set."""
    model, _ = load_model(model_dir, "float32", device="cpu")
    model.train()
    if train_top_layers is not None:
        trainable = freeze_below_top_layers(model, train_top_layers)
        print(f"training the top {train_top_layers} blocks and the final norm: {trainable / 1e6:.1f}M of "
              f"{model.num_parameters() / 1e6:.1f}M parameters", flush=True)
    return model


def training_examples(cfg: SFTConfig, spec: EnvSpec, demos: list[Demonstration], relabel_tasks: list[str], tokenizer: Any,
                      model_config: Any) -> tuple[list, dict[str, Any] | None]:
    """The expert's turns (shown as the model reads them: screenshots for a vision-language model in an
    env that shows them), and the relabelled student states when the recipe asks for them (with
    their figures); every turn must fit the model's positions."""
    examples = demo_examples(demos, spec, cfg.env, tokenizer, image_tokens_of(model_config), cfg.prompt,
                             reader_for(cfg.model))
    max_positions = model_positions(model_config)
    if not examples:
        raise RuntimeError(f"the expert won none of its {len(demos)} episodes: nothing to train on")
    expert_turns = len(examples)
    relabel = relabel_student_states(cfg, spec, relabel_tasks, tokenizer) if relabel_tasks else None
    if relabel is not None:
        examples += relabel.pop("examples")
    longest = max(len(ex.prompt_ids) + len(ex.answer_ids) for ex in examples)
    if longest > max_positions:
        fix = (f"a chat holds its episode so far: lower env.max_turns (now {cfg.env.max_turns})"
               if cfg.prompt.style == "chat" else f"lower env.history_length (now {cfg.env.history_length})")
        raise RecipeError(f"a demonstration turn has {longest} tokens, more than the model's {max_positions} "
                          f"positions; {fix}")
    relabelled = f" and {len(examples) - expert_turns} relabelled student turns" if relabel is not None else ""
    print(f"{sum(d.won for d in demos)}/{len(demos)} expert episodes won -> {expert_turns} turns{relabelled}, "
          f"{sum(len(ex.answer_ids) for ex in examples)} answer tokens; longest turn {longest} tokens", flush=True)
    return examples, relabel


def evaluate_sft_model(cfg: SFTConfig, spec: EnvSpec, output: Path, dtype: str, eval_tasks: list[str],
                       eval_split: str) -> EvalResult:
    """The fine-tuned model's greedy Avg@1 on the held-out tasks (episodes the env ended count as lost),
    with a progress line (rate and ETA). `cfg`: any recipe with env, policy, prompt and seed."""
    policy = make_policy(cfg.policy, str(output), dtype=dtype, seed=cfg.seed)
    attach_screens(spec, output, policy, reader=reader_for(cfg.model))
    try:
        with EnvPool.for_config(spec, cfg.env) as pool, \
                EpisodeProgress(f"held-out eval {output.name}", len(eval_tasks)) as progress:
            result = evaluate(spec, pool, policy, eval_tasks, split=eval_split, env_config=cfg.env,
                              policy_config=cfg.policy, k=1, seed=cfg.seed, prompt=cfg.prompt,
                              on_episode=progress.episode_done)
    finally:
        policy.close()
    if result.env_failures:
        print(f"WARNING: held-out eval: {result.describe_env_failures()}; they count as lost", flush=True)
    return result


def ensure_model(model: ModelConfig, key: str) -> Path:
    """The model folder of a recipe's model block, built by its preparation when missing."""
    path = Path(model.path).expanduser()
    if not path.exists():
        if model.prepare is None:
            raise RecipeError(f"recipe key '{key}.path': {path} does not exist and '{key}.prepare' is not set")
        prepare_model(model.prepare, path, **model.prepare_options)
    return path


def relabel_task_ids(cfg: SFTConfig, spec: EnvSpec, split: str) -> list[str]:
    """The relabel.episodes tasks the relabelled student plays (round-robin over relabel.task_types),
    checked before any heavy work, as is the env's expert (it must act from the student's states)."""
    relabel = cfg.relabel
    try:
        split = relabel.split or split
        ordered = demo_tasks(spec, split, len(split_tasks(spec, split)), cfg.seed + RELABEL_SALT)
    except ValueError as exc:
        raise RecipeError(f"recipe key 'relabel.split': {exc}") from None
    tasks = [task for task in ordered
             if relabel.task_types is None or spec.task_type(task) in relabel.task_types][:relabel.episodes]
    if not tasks:
        raise RecipeError(f"recipe key 'relabel.task_types': {relabel.task_types} has no task in {split} "
                          f"(env.task_types: {cfg.env.task_types})")
    try:
        require_relabelling_expert(spec, tasks[0])
    except ValueError as exc:
        raise RecipeError(f"recipe key 'relabel.student': {exc}") from None
    return tasks


def relabel_student_states(cfg: SFTConfig, spec: EnvSpec, tasks: list[str], tokenizer: Any) -> dict[str, Any]:
    """relabel.student plays `tasks` at full depth; the env's expert labels the states it reached
    (envs.demonstrations.relabel_episodes). Returns their training turns (`examples`) and what they
    were (SFTResult.relabel)."""
    relabel, start = cfg.relabel, time.perf_counter()
    assert relabel.student is not None
    path = ensure_model(relabel.student, "relabel.student")
    print(f"relabel: the student {path} plays {len(tasks)} train episodes "
          f"(temperature {relabel.temperature:g}); the {spec.name} expert labels every state it reaches", flush=True)
    policy = make_policy(cfg.policy, str(path), dtype=relabel.student.dtype, seed=cfg.seed)
    sampling = SamplingParams(temperature=relabel.temperature, top_p=cfg.policy.top_p,
                              max_new_tokens=cfg.policy.max_new_tokens, stop=tuple(cfg.policy.stop), seed=cfg.seed)
    try:
        with EnvPool.for_config(spec, cfg.env) as pool:
            trajectories = rollout(spec, pool, policy, tasks, env_config=cfg.env, sampling=sampling, prompt=cfg.prompt)
    finally:
        policy.close()
    played = [t for t in trajectories if not t.env_error]
    relabelled = relabel_episodes(spec, cfg.env, [
        (t.task_id, [spec.parse_action(turn.action_text).action for turn in t.turns]) for t in played])
    steps = [step for demo in relabelled for step in demo.steps]
    imitated = [step for step in steps if step.imitate]
    summary = {"episodes": len(played), "student_success": statistics.fmean(t.success for t in played) if played else 0.0,
               "states": len(steps), "imitated": len(imitated),
               "agreement": statistics.fmean(s.action == s.label for s in imitated) if imitated else 0.0,
               "seconds": time.perf_counter() - start}
    print(f"relabel: {summary['states']} student states ({100 * summary['student_success']:.0f}% of the episodes won); "
          f"the expert acts from {summary['imitated']}, where the student agreed with it "
          f"{100 * summary['agreement']:.0f}% of the time ({summary['seconds']:.0f} s)", flush=True)
    return {**summary, "examples": demo_examples(relabelled, spec, cfg.env, tokenizer, prompt=cfg.prompt)}


def freeze_below_top_layers(model: Any, top_layers: int) -> int:
    """Freeze every parameter of an HF decoder-only model but its last `top_layers` blocks and its
    final norm; returns how many parameters stay trainable. The input embeddings are frozen too
    (with tied embeddings that is the LM head as well), so no gradient flows below the top blocks."""
    decoder = model.get_decoder()
    blocks, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if blocks is None or norm is None:
        raise RecipeError(f"recipe key 'train_top_layers': {type(model).__name__} has no decoder `layers` and "
                          "`norm` (Llama/Qwen-shaped models do); set it to null to train every parameter")
    if top_layers > len(blocks):
        raise RecipeError(f"recipe key 'train_top_layers': {top_layers}, but the model has {len(blocks)} blocks")
    model.requires_grad_(False)
    for module in [*blocks[-top_layers:], norm]:
        module.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def train_examples(trainer: Any, examples: list[SFTExample], cfg: Any, label: str = "sft",
                   checkpoints: SFTCheckpoints | None = None) -> list[tuple[float, float]]:
    """cfg.trainer.steps optimizer steps on batches of cfg.batch_turns examples (shuffled epochs),
    with a progress bar named `label`; returns (loss, seconds) per step. With `checkpoints`, the
    steps of a killed build are restored first and their batches passed over (the batch order is the
    seed's), and the state is saved as they say."""
    out: list[tuple[float, float]] = checkpoints.resume(trainer) if checkpoints else []
    log_every = max(1, cfg.trainer.steps // 10)
    progress = progress_bar(label, "loss {task.fields[loss]} | {task.fields[tps]} tok/s")
    with progress:
        bar = progress.add_task(label, total=cfg.trainer.steps, completed=len(out), loss="-", tps="-")
        groups = conversations(examples)
        for step, indices in enumerate(batches([len(g) for g in groups], cfg.batch_turns, cfg.trainer.steps, cfg.seed)):
            if step < len(out):
                continue
            batch = example_batch([[examples[i] for i in groups[g]] for g in indices], cfg.env.name)
            start = time.perf_counter()
            metrics = trainer.step(batch, alpha=0.0)
            seconds = time.perf_counter() - start
            out.append((float(metrics.loss), seconds))
            if checkpoints:
                checkpoints.after_step(trainer, out, cfg.trainer.steps)
            progress.update(bar, advance=1, loss=f"{metrics.loss:.3f}", tps=f"{batch.num_tokens / seconds:.0f}")
            if not progress.console.is_terminal and len(out) % log_every == 0:  # a log file gets lines
                elapsed = sum(t for _, t in out)
                progress.console.print(f"{label} step {len(out)}/{cfg.trainer.steps}: loss {metrics.loss:.3f}, "
                                       f"{elapsed:.0f} s, ETA {elapsed / len(out) * (cfg.trainer.steps - len(out)):.0f} s")
    return out


@dataclass
class SFTCheckpoints:
    """A build's resumable state (turnopd.core.checkpoint: written atomically, the newest kept) in
    `root`, beside the output folder rather than in it (the output is the teacher's model folder):
    after every `every`-th step and the last, the trainer's state and the step losses so far.
    `recipe.yaml` holds the training part of the recipe that wrote them; another is refused."""

    root: Path
    every: int
    recipe: str  # the recipe's YAML less what only the evaluation after training reads
    tokenizer: Any = None

    @classmethod
    def of(cls, cfg: SFTConfig, final_dir: Path | None = None) -> SFTCheckpoints:
        """The checkpoints of cfg's build, beside `final_dir` (default: cfg.output_dir)."""
        out = Path(final_dir or cfg.output_dir).expanduser()
        where = ("eval", "teacher_spec", "checkpoint_every", "output_dir")  # not what training reads
        training = OmegaConf.masked_copy(OmegaConf.structured(cfg),
                                         [k for k in SFTConfig.__dataclass_fields__ if k not in where])
        found = cls(out.with_name(f"{out.name}.checkpoints"), cfg.checkpoint_every, OmegaConf.to_yaml(training))
        saved = found.root / "recipe.yaml"
        if ckpt.list_checkpoints(found.root) and saved.read_text() != found.recipe:
            keys = differing_keys(OmegaConf.create(saved.read_text()), OmegaConf.create(found.recipe))
            raise RecipeError(f"{found.root} holds the checkpoints of a killed build whose recipe differs in "
                              f"{keys}: run that recipe to finish it, or delete the folder to start this one")
        return found

    def with_tokenizer(self, tokenizer: Any) -> SFTCheckpoints | None:
        """These checkpoints saving `tokenizer` too (a checkpoint folder loads on its own); None when
        the recipe asks for none and none are left to resume."""
        if not self.every and not ckpt.list_checkpoints(self.root):
            return None
        return replace(self, tokenizer=tokenizer)

    def resume(self, trainer: Any) -> list[tuple[float, float]]:
        """The (loss, seconds) of the steps the newest readable checkpoint holds, its state loaded
        into `trainer`; [] when there is none."""
        state = ckpt.restore_checkpoint(self.root, trainer)
        if state is None:
            return []
        print(f"resuming the build from {self.root} at step {state['step']}", flush=True)
        return [tuple(pair) for pair in state["losses"]]

    def after_step(self, trainer: Any, losses: list[tuple[float, float]], total: int) -> None:
        if self.every and (len(losses) % self.every == 0 or len(losses) == total):
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "recipe.yaml").write_text(self.recipe)
            ckpt.save_checkpoint(self.root, len(losses), trainer, self.tokenizer, {"losses": losses}, keep_last=1)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def save_model(trainer: Any, tokenizer: Any, output: Path, model_dir: Path | None = None) -> None:
    """The trained model (gathered from its ZeRO shards) and its tokenizer, in Hugging Face format;
    a vision-language model's processor too (from `model_dir`, the folder it was trained from)."""
    output.mkdir(parents=True, exist_ok=True)
    with trainer.gathered_parameters() as module:
        module.save_pretrained(output)
    tokenizer.save_pretrained(output)
    if model_dir is not None and is_vision_language(model_dir):
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(model_dir).save_pretrained(output)


def _write_teacher_spec(cfg: SFTConfig, output: Path, tokenizer: Any, recipe: str | None, dtype: str,
                        held_out: str) -> Path:
    spec = TeacherSpec(name=f"{cfg.env.name}-{cfg.name}", model=str(output), backend="transformers",
                       dtype=dtype, max_length=int(tokenizer.model_max_length),
                       sft_recipe=str(Path(recipe).resolve()) if recipe else None)
    if recipe:
        comment = (f"Written by `turnopd sft {recipe}` ({held_out}).\n"
                   "`turnopd distill` retrains the model from sft_recipe when its folder is missing.")
    else:  # run_sft called from Python: no recipe file to name or to retrain from
        comment = f"Written by turnopd.orchestration.sft.run_sft ({held_out})."
    return save_teacher_spec(spec, cfg.teacher_spec, comment)


def print_sft_summary(cfg: SFTConfig, s: SFTResult) -> None:
    from rich.console import Console

    console = Console()
    console.print(f"[bold]{cfg.name}[/]: {s.steps} steps on {s.examples} demonstration turns "
                  f"({s.demos_won}/{s.demos_played} expert episodes won) in {s.train_time_s:.0f} s; "
                  f"loss {s.first_loss:.3f} -> {s.final_loss:.3f}")
    per_type = ", ".join(f"{k} {100 * v:.1f}%" for k, v in s.per_type.items())
    if s.relabel is not None:
        console.print(f"of them {s.relabel['imitated']} relabelled student states ({s.relabel['episodes']} student episodes, "
                      f"the student agreeing with the expert at {100 * s.relabel['agreement']:.0f}% of them)")
    if cfg.eval.enabled:
        console.print(f"held-out Avg@1 on {s.eval_split} ({s.eval_tasks} tasks, greedy): [bold]{100 * s.avg_at_1:.1f}%[/] "
                      f"({per_type}); mean {s.eval_mean_turns:.1f} turns; eval {s.eval_time_s:.0f} s")
    console.print(f"checkpoint: {s.output_dir}" + (f"; teacher spec: {s.teacher_spec}" if s.teacher_spec else ""))
    console.print(f"wall clock {s.wall_time_s:.0f} s (model build and demonstrations {s.prepare_time_s:.0f} s)")


@MODEL_PREPARERS.register("sft")
def prepare_sft(out_dir: Path, recipe: str, overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """The model preparation `sft`: the model `turnopd sft RECIPE [overrides]` trains, built into out_dir
    (atomically) with no teacher spec written and no held-out evaluation. A weaker student is the same
    recipe with fewer steps (`overrides: [trainer.steps=40]`); a teacher spec's `sft_recipe` builds its
    teacher this way. A relative recipe path is taken from the working directory, then the repository."""
    recipe_path = resolve_repo_path(recipe)
    # named after its folder: its summary line says which model was built (a student, not the recipe's teacher)
    cfg = load_sft_recipe(str(recipe_path), [*overrides, f"name={Path(out_dir).name}", "teacher_spec=null",
                                             "eval.enabled=false"])
    with building(Path(out_dir), {"builder": "sft", "recipe": str(recipe_path), "overrides": list(overrides)}) as tmp:
        cfg.output_dir = str(tmp)
        run_sft(cfg, final_dir=Path(out_dir))
    return Path(out_dir)


def resolve_repo_path(path: str) -> Path:
    given = Path(path).expanduser()
    for candidate in (given, REPO_ROOT / given):
        if candidate.exists():
            return candidate.resolve()
    raise RecipeError(f"SFT recipe {path} not found (looked in the working directory and {REPO_ROOT})")


def build_missing_teacher(spec: TeacherSpec) -> None:
    """Train the teacher of a spec with `sft_recipe` when its model folder does not exist yet."""
    if spec.sft_recipe and not Path(spec.model).exists():
        print(f"teacher {spec.name}: {spec.model} does not exist; training it with turnopd sft {spec.sft_recipe}",
              flush=True)
        prepare_model("sft", spec.model, recipe=spec.sft_recipe)
