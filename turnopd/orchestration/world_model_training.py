"""World models of an env: a model trained on logged real transitions to write the env's answer.

    turnopd world-model train recipes/alfworld/world_model.yaml [key=value ...]
    turnopd world-model eval recipes/alfworld/world_model.yaml    # steps 3-4 again, for the trained model

1. Transitions (envs.transitions): the env's expert plays `data.expert_episodes` train tasks (the
   cached demonstrations `turnopd sft` uses, exploring mistakes included: the env's answers to them
   are real too) and, with `data.student` set, that student plays `data.student_episodes` train
   tasks at `data.temperature`, so the model also sees the states and mistakes of the player it
   will stand in an env for. Every step of every episode is one transition.
2. Training: the DeepSpeed trainer with objective `nll` and `token_mean` loss: the mean negative
   log-likelihood of the answer tokens (status line, next observation, EOS) given the prompt
   (envs.transitions' text, as one chat user message).
3. Held-out fidelity: the same players on `data.held_out_episodes` tasks of env.eval_split. The
   model's greedy answer is compared with the env's: exact match and token-F1 of the observation,
   accuracy of the status; P(done) and P(won) come from the status probabilities (the softmax over
   the three status lines' log-likelihoods after the prompt), and their calibration is the ECE.
   Reported for all transitions, per source (expert, student) and per action verb, which is where
   the errors show. Then whole episodes: each held-out episode's actions replayed greedily in the
   model from its first observation, each after the model's own answers (as in a model episode and
   as Online Debiasing's `replay` verdict does), against the real ending: where per-step errors
   compound into an easier or harder env. For an env whose steps report a metric (envs.base.MetricReader:
   autoresearch's validation accuracy), on the held-out steps that report one: the mean absolute
   error of the metric the greedy answer writes, and for the event "the change helps" (the env kept
   it) the AUROC and ECE of P(helps), the share of `metric_samples` answers sampled at temperature 1
   that say it helps.
4. Output: the model and its tokenizer in Hugging Face format in output_dir, and world_model.json:
   the env and prompt settings it was trained for, what it was trained on, the fidelity table.

`kind: job_model` (autoresearch only) replaces steps 1-2: changes of the train tasks labelled by
real jobs, and an ensemble that predicts each job's accuracy (envs.autoresearch.job_model); the env
computes the answers around it. Steps 3-4 are the same, graded on the same held-out players
(`measure_answerer_fidelity`), and world_model.json says kind "answerer".
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from envs import make_env_spec
from envs.base import EnvSpec, MetricReader, MetricReading, WorldAnswerer
from envs.demonstrations import collect_demonstrations, demo_tasks
from envs.pool import EnvPool
from envs.transitions import (
    STATUSES,
    Transition,
    demo_transitions,
    parse_world_answer,
    split_episodes,
    trajectory_transitions,
    transition_prompt,
)
from turnopd.algorithm.world_model_corrections import auroc, expected_calibration_error, token_f1
from turnopd.config import (
    EnvConfig,
    LossConfig,
    ModelConfig,
    ObjectiveConfig,
    PolicyConfig,
    RecipeError,
    TrainerConfig,
    compose,
)
from turnopd.loaders.hf_models import load_model
from turnopd.orchestration.preflight import train_and_eval_tasks
from turnopd.orchestration.recipe import validate_recipe
from turnopd.orchestration.sft import SFTExample, ensure_model, save_model, train_examples
from turnopd.rollout import SamplingParams, make_policy
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.base import generate_all, request_seed
from turnopd.rollout.render import chat_prompt_ids
from turnopd.rollout.world_model_pool import ANSWERER_KIND, Verdict, WorldModelPool, listed

WORLD_MODEL_FORMAT = 1  # the prompt/answer text of envs.transitions
HELD_OUT_SALT = 7_777  # the held-out student episodes' sampling seed, apart from the training ones'
HELPS_ECE_BINS = 10  # equal-width bins of P(the change helps)


@dataclass
class TransitionDataConfig:
    expert_episodes: int = field(default=100, metadata={"range": (1, None)})  # train tasks the env's expert plays
    student: ModelConfig | None = None  # null: expert transitions only
    student_episodes: int = field(default=32, metadata={"range": (1, None)})  # train tasks the student plays
    temperature: float = field(default=0.5, metadata={"range": (0.0, None)})  # the student's sampling
    held_out_episodes: int = field(default=20, metadata={"range": (1, None)})  # env.eval_split tasks, per player


@dataclass
class JobModelConfig:
    """kind: job_model (env autoresearch): the labels and the ensemble of envs.autoresearch.job_model."""

    walks_per_task: int = field(default=8, metadata={"range": (0, None)})  # keep-or-revert walks from each train start
    walk_turns: int = field(default=12, metadata={"range": (1, None)})  # random single changes a walk
    members: int = field(default=8, metadata={"range": (1, None)})  # ensemble members, each on its own bootstrap
    hidden: int = field(default=64, metadata={"range": (1, None)})
    steps: int = field(default=500, metadata={"range": (1, None)})  # full-batch Adam steps a member
    lr: float = field(default=3.0e-3, metadata={"range": (0.0, None)})


@dataclass
class WorldModelConfig:
    """A `turnopd world-model train` recipe: `trainer.steps` optimizer steps of `batch_turns`
    transitions. `policy` is the student's generation (its episodes); `max_observation_tokens`
    bounds the world model's answer."""

    name: str = MISSING
    seed: int = 0
    data_dir: str | None = None
    # language_model: an LM writes the env's answer; job_model (autoresearch): the env answers, each
    # job's accuracy predicted from the numbers (envs.autoresearch.job_model); `model` and `trainer` unused
    kind: str = field(default="language_model", metadata={"choices": ("language_model", "job_model")})
    job_model: JobModelConfig = field(default_factory=JobModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig | None = None  # the language model to train (built by its `prepare` if missing)
    data: TransitionDataConfig = field(default_factory=TransitionDataConfig)
    history_length: int = field(default=1, metadata={"range": (0, None)})  # (observation, action) pairs in the prompt
    max_observation_tokens: int = field(default=160, metadata={"range": (1, None)})
    metric_samples: int = field(default=8, metadata={"range": (1, None)})  # answers per step behind P(helps)
    batch_turns: int = field(default=32, metadata={"range": (1, None)})
    trainer: TrainerConfig = field(default_factory=lambda: TrainerConfig(steps=300, lr=1e-3))
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    output_dir: str = "runs/world_models/${env.name}"


def check_kind(cfg: WorldModelConfig) -> None:
    if cfg.kind == "language_model" and cfg.model is None:
        raise RecipeError("recipe key 'model': kind language_model trains a model: name it (model.path, model.prepare)")
    if cfg.kind == "job_model" and cfg.env.name != "autoresearch":
        raise RecipeError(f"recipe key 'kind': job_model predicts a training job's accuracy, so it models env "
                          f"autoresearch only, not env.name={cfg.env.name!r}; use kind language_model")


def load_world_model_recipe(recipe: str, overrides: list[str] | tuple[str, ...] = ()) -> WorldModelConfig:
    return validate_recipe(compose(recipe, overrides), schema=WorldModelConfig, checks=[check_kind])


# ---------------------------------------------------------------------------------------------
# Transitions
# ---------------------------------------------------------------------------------------------


def player_transitions(cfg: WorldModelConfig, spec: EnvSpec, split: str, expert_episodes: int,
                       student_episodes: int, seed: int) -> list[Transition]:
    """The transitions of the expert's episodes on `expert_episodes` tasks of `split` and, with
    data.student set, of the student's on `student_episodes` tasks (both drawn round-robin over task
    types, envs.demonstrations.demo_tasks)."""
    out = [t for demo in collect_demonstrations(spec, cfg.env, split, expert_episodes, cfg.seed)
           for t in demo_transitions(demo, cfg.history_length)]
    if cfg.data.student is None:
        return out
    path = ensure_model(cfg.data.student, "data.student")
    tasks = demo_tasks(spec, split, student_episodes, cfg.seed)
    print(f"the student {path} plays {len(tasks)} {split} tasks (temperature {cfg.data.temperature:g})", flush=True)
    policy = make_policy(cfg.policy, str(path), dtype=cfg.data.student.dtype, seed=seed)
    sampling = SamplingParams(temperature=cfg.data.temperature, top_p=cfg.policy.top_p,
                              max_new_tokens=cfg.policy.max_new_tokens, stop=tuple(cfg.policy.stop), seed=seed)
    try:
        with EnvPool.for_config(spec, cfg.env) as pool:
            trajectories = rollout(spec, pool, policy, tasks, env_config=cfg.env, sampling=sampling)
    finally:
        policy.close()
    return out + [t for trajectory in trajectories
                  for t in trajectory_transitions(trajectory, spec.parse_action, cfg.history_length)]


def transition_example(t: Transition, tokenizer: Any) -> SFTExample:
    """The prompt and the answer tokens the model learns: the status line, then the observation (encoded
    apart, so the status tokens are the same ones `status_probabilities` scores), then EOS."""
    answer = status_ids(tokenizer, t.status) + tokenizer.encode(t.next_observation, add_special_tokens=False)
    return SFTExample(t.task_id, t.step, chat_prompt_ids(tokenizer, transition_prompt(t)),
                      answer + [tokenizer.eos_token_id])


def status_ids(tokenizer: Any, status: str) -> list[int]:
    return tokenizer.encode(f"{status}\n", add_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Fidelity
# ---------------------------------------------------------------------------------------------


def status_probabilities(model: Any, tokenizer: Any, prompts: list[list[int]]) -> list[dict[str, float]]:
    """Per prompt, P(status) for each of STATUSES: the softmax over the log-likelihoods of the status
    lines after the prompt (each line's token log-probs summed), one padded batch per prompt."""
    import torch

    candidates = [status_ids(tokenizer, status) for status in STATUSES]
    out = []
    with torch.no_grad():
        for prompt in prompts:
            width = len(prompt) + max(map(len, candidates))
            ids = torch.full((len(candidates), width), tokenizer.pad_token_id or 0, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, candidate in enumerate(candidates):
                ids[row, :len(prompt) + len(candidate)] = torch.tensor(prompt + candidate)
                mask[row, :len(prompt) + len(candidate)] = 1
            device = next(model.parameters()).device
            logprobs = torch.log_softmax(model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float(),
                                         dim=-1).cpu()
            scores = torch.stack([
                logprobs[row, len(prompt) - 1 + torch.arange(len(c)), torch.tensor(c)].sum()
                for row, c in enumerate(candidates)])
            out.append(dict(zip(STATUSES, torch.softmax(scores, dim=0).tolist(), strict=True)))
    return out


@dataclass
class FidelityRow:
    transitions: int
    exact_match: float  # share of predicted observations equal to the env's (whitespace-normalised)
    token_f1: float  # mean token-F1 of predicted against real observations
    status_accuracy: float  # share of greedy status lines equal to the env's (continue / won / lost)
    done_ece: float | None = None  # ECE of P(done) = P(won) + P(lost); None for per-verb rows
    won_ece: float | None = None


def fidelity_row(items: list[tuple[Transition, str, dict[str, float]]], calibration: bool) -> FidelityRow:
    """One row of the fidelity table from (transition, the model's greedy answer, its P(status))."""
    exact, f1, status_ok = [], [], []
    for t, answer, _ in items:
        parsed = parse_world_answer(answer)
        status, observation = parsed if parsed is not None else ("", answer)
        exact.append(" ".join(observation.split()) == " ".join(t.next_observation.split()))
        f1.append(token_f1(observation, t.next_observation))
        status_ok.append(status == t.status)
    row = FidelityRow(len(items), statistics.fmean(exact), statistics.fmean(f1), statistics.fmean(status_ok))
    if calibration:
        row.done_ece = expected_calibration_error([1.0 - p["continue"] for _, _, p in items], [t.done for t, _, _ in items])
        row.won_ece = expected_calibration_error([p["won"] for _, _, p in items], [t.won for t, _, _ in items])
    return row


def fidelity_table(transitions: list[Transition], answers: list[str],
                   probabilities: list[dict[str, float]]) -> dict[str, FidelityRow]:
    """Rows "all", "source=<expert|student>" and "verb=<first word of the action>" (most frequent first)."""
    items = list(zip(transitions, answers, probabilities, strict=True))
    groups = by_source(items, lambda item: item[0].source)
    verbs: dict[str, list[Any]] = {}
    for item in items:
        verbs.setdefault(f"verb={(item[0].action.split() or [''])[0]}", []).append(item)
    groups.update(sorted(verbs.items(), key=lambda kv: -len(kv[1])))
    return {key: fidelity_row(group, calibration=not key.startswith("verb=")) for key, group in groups.items()}


def by_source(items: list[Any], source: Any) -> dict[str, list[Any]]:
    """{"all": items, "source=<source(item)>": those items, ...} in order of first appearance."""
    groups: dict[str, list[Any]] = {"all": items}
    for item in items:
        groups.setdefault(f"source={source(item)}", []).append(item)
    return groups


def answer_observation(answer: str) -> str:
    """The observation of a world model's answer (the whole text when it has no status line)."""
    parsed = parse_world_answer(answer)
    return answer if parsed is None else parsed[1]


@dataclass
class MetricRow:
    changes: int  # held-out steps whose real answer reports a metric (a scored change)
    helped: int  # of them, those where the change helped (the env kept it)
    parsed: int  # of them, those whose greedy answer reports a metric too
    metric_mae: float | None  # mean |predicted - real| metric over the parsed ones, in the env's units
    helps_auroc: float | None  # AUROC of P(helps) for "it helped"; None with one class only
    helps_ece: float  # ECE of P(helps), HELPS_ECE_BINS equal-width bins


def metric_row(items: list[tuple[MetricReading, MetricReading | None, float]]) -> MetricRow:
    """One row of the metric table from (the real reading, the greedy answer's reading or None, the
    model's P(helps)): MAE = mean |m_pred - m_real| over the steps whose answer reports a metric."""
    errors = [abs(pred.metric - real.metric) for real, pred, _ in items if pred is not None]
    labels, probabilities = [real.helps for real, _, _ in items], [p for _, _, p in items]
    return MetricRow(len(items), sum(labels), len(errors), statistics.fmean(errors) if errors else None,
                     auroc(probabilities, labels), expected_calibration_error(probabilities, labels, HELPS_ECE_BINS))


def metric_table(reader: MetricReader, transitions: list[Transition], answers: list[str],
                 samples: list[list[str]]) -> dict[str, MetricRow]:
    """Rows "all" and "source=<expert|student>" over the transitions whose real next observation
    reports a metric; `answers` are the greedy answers to those transitions, `samples` each one's
    sampled answers, P(helps) being the share of them whose observation reads as helping (an answer
    that reports no metric does not say it helps). Empty when no transition reports a metric."""
    items = []
    for t, answer, sampled in zip(transitions, answers, samples, strict=True):
        real = reader.read_metric(t.next_observation)
        if real is None:
            continue
        readings = [reader.read_metric(answer_observation(a)) for a in sampled]
        helps = sum(r is not None and r.helps for r in readings) / len(readings)
        items.append((t, (real, reader.read_metric(answer_observation(answer)), helps)))
    if not items:
        return {}
    return {key: metric_row([item for _, item in group])
            for key, group in by_source(items, lambda item: item[0].source).items()}


@dataclass
class ReplayRow:
    episodes: int  # with a verdict (a replay with an unusable answer is left out, counted in no_verdict)
    won_real: float  # share the env ended won
    won_replayed: float  # share whose replay the model ended won
    same_ending: float  # share where the two agree (won, or not)
    turns_real: float  # mean turns of the real episodes
    turns_replayed: float  # mean model steps until the model's ending (or the actions ran out)
    no_verdict: int = 0


def replay_table(episodes: list[list[Transition]], verdicts: list[Verdict]) -> dict[str, ReplayRow]:
    """Rows "all" and "source=<expert|student>" of the episode replays: each real episode's ending
    (won: its last transition's) against the model's verdict on its actions (Verdict(success, steps),
    success None: no usable answer)."""
    if len(episodes) != len(verdicts):
        raise ValueError(f"{len(episodes)} episodes for {len(verdicts)} verdicts")
    rows = {}
    for key, group in by_source(list(zip(episodes, verdicts, strict=True)), lambda item: item[0][0].source).items():
        judged = [(episode, v) for episode, v in group if v.success is not None]
        if not judged:
            rows[key] = ReplayRow(0, math.nan, math.nan, math.nan, math.nan, math.nan, no_verdict=len(group))
            continue
        won = [episode[-1].won for episode, _ in judged]
        replayed = [v.success == 1.0 for _, v in judged]
        rows[key] = ReplayRow(
            len(judged), statistics.fmean(won), statistics.fmean(replayed),
            statistics.fmean(a == b for a, b in zip(won, replayed, strict=True)),
            statistics.fmean(len(episode) for episode, _ in judged), statistics.fmean(v.steps for _, v in judged),
            no_verdict=len(group) - len(judged))
    return rows


def replay_episodes(spec: EnvSpec, model: Any, episodes: list[list[Transition]], cfg: WorldModelConfig) -> list[Verdict]:
    """Each episode's actions replayed greedily in the world model (a Policy or a WorldAnswerer), all
    episodes at once."""
    world = WorldModelPool(spec, None, model, history_length=cfg.history_length,
                           max_observation_tokens=cfg.max_observation_tokens, temperature=0.0, seed=cfg.seed)

    async def replay_all() -> list[Verdict]:
        return list(await asyncio.gather(*(world.replay(e[0].task, e[0].first_observation,
                                                        listed([t.action for t in e]), slot)
                                           for slot, e in enumerate(episodes))))

    return asyncio.run(replay_all())


def measure_fidelity(model_dir: Path, transitions: list[Transition], prompts: list[list[int]],
                     cfg: WorldModelConfig, spec: EnvSpec
                     ) -> tuple[dict[str, FidelityRow], dict[str, ReplayRow], dict[str, MetricRow] | None]:
    """The world model in model_dir on held-out transitions (`prompts`: their token ids): greedy
    answers and status probabilities, the episode replays and, for an env that reports a metric, the
    metric table (None otherwise), from one loaded copy of the model."""
    model, tokenizer = load_model(model_dir, "float32")  # on the run's device
    greedy = PolicyConfig(backend=cfg.policy.backend, temperature=0.0, max_new_tokens=cfg.max_observation_tokens,
                          stop=[], max_batch_size=cfg.policy.max_batch_size)
    policy = make_policy(greedy, model, tokenizer=tokenizer, dtype="float32", seed=cfg.seed)
    try:
        answers = [g.text for g in generate_all(policy, prompts, SamplingParams(
            temperature=0.0, max_new_tokens=cfg.max_observation_tokens, stop=(), seed=cfg.seed))]
        episodes = split_episodes(transitions)
        replays = replay_table(episodes, replay_episodes(spec, policy, episodes, cfg))
        metric = None
        if isinstance(spec, MetricReader):  # samples only for the steps that report a metric (~70% here)
            k = cfg.metric_samples
            scored = [i for i, t in enumerate(transitions) if spec.read_metric(t.next_observation) is not None]
            sampled = [g.text for g in generate_all(policy, [prompts[i] for i in scored for _ in range(k)], SamplingParams(
                temperature=1.0, max_new_tokens=cfg.max_observation_tokens, stop=(), seed=cfg.seed))]
            metric = metric_table(spec, [transitions[i] for i in scored], [answers[i] for i in scored],
                                  [sampled[j * k:(j + 1) * k] for j in range(len(scored))])
    finally:
        policy.close()
    return fidelity_table(transitions, answers, status_probabilities(model, tokenizer, prompts)), replays, metric


def measure_answerer_fidelity(answerer: WorldAnswerer, transitions: list[Transition], cfg: WorldModelConfig,
                              spec: EnvSpec
                              ) -> tuple[dict[str, FidelityRow], dict[str, ReplayRow], dict[str, MetricRow] | None]:
    """`measure_fidelity`'s tables for a world model that computes its answers: the greedy answer is
    its temperature-0 one, P(status) and P(helps) the shares of `metric_samples` answers at temperature 1."""
    prompts = [transition_prompt(t) for t in transitions]
    answers = [answerer.answers(p, [cfg.seed], 0.0)[0] for p in prompts]
    seeds = [request_seed(cfg.seed, i, k) for i in range(len(prompts)) for k in range(cfg.metric_samples)]
    sampled = [answerer.answers(p, seeds[i * cfg.metric_samples:(i + 1) * cfg.metric_samples], 1.0)
               for i, p in enumerate(prompts)]
    probabilities = [{status: sum((parsed := parse_world_answer(a)) is not None and parsed[0] == status
                                  for a in answers_i) / len(answers_i) for status in STATUSES}
                     for answers_i in sampled]
    episodes = split_episodes(transitions)
    replays = replay_table(episodes, replay_episodes(spec, answerer, episodes, cfg))
    metric = None
    if isinstance(spec, MetricReader):
        scored = [i for i, t in enumerate(transitions) if spec.read_metric(t.next_observation) is not None]
        metric = metric_table(spec, [transitions[i] for i in scored], [answers[i] for i in scored],
                              [sampled[i] for i in scored])
    return fidelity_table(transitions, answers, probabilities), replays, metric


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class WorldModelResult:
    output_dir: str
    train_transitions: dict[str, int]  # per source
    answer_tokens: int
    steps: int
    first_loss: float
    final_loss: float  # mean of the last 10 steps
    train_time_s: float
    held_out_split: str
    fidelity: dict[str, FidelityRow]
    replay: dict[str, ReplayRow]  # the held-out episodes replayed in the model
    metric: dict[str, MetricRow] | None  # for an env whose steps report a metric (envs.base.MetricReader)
    data_time_s: float  # building the model (if missing), playing the episodes (demonstrations are cached)
    wall_time_s: float


def run_world_model_train(cfg: WorldModelConfig) -> WorldModelResult:
    """Transitions -> trained world model -> held-out fidelity -> world_model.json."""
    if cfg.kind == "job_model":
        return run_job_model_train(cfg)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turnopd.trainer import Trainer

    wall_start = time.perf_counter()
    spec = make_env_spec(cfg.env, cfg.data_dir)
    train_split, _, held_out_split, _ = train_and_eval_tasks(spec, cfg.env, eval_split=None, max_eval_tasks=None)
    model_dir = ensure_model(cfg.model, "model")
    train = player_transitions(cfg, spec, train_split, cfg.data.expert_episodes, cfg.data.student_episodes, cfg.seed)
    held_out = held_out_transitions(cfg, spec, held_out_split)
    data_time = time.perf_counter() - wall_start

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = [transition_example(t, tokenizer) for t in train]
    longest = max(len(ex.prompt_ids) + len(ex.answer_ids) for ex in examples)
    held_out_prompts = [chat_prompt_ids(tokenizer, transition_prompt(t)) for t in held_out]
    held_out_prompt = max(map(len, held_out_prompts))
    positions = model.config.max_position_embeddings
    if max(longest, held_out_prompt + cfg.max_observation_tokens) > positions:
        raise RecipeError(f"a transition needs {max(longest, held_out_prompt + cfg.max_observation_tokens)} tokens "
                          f"(prompt and answer, or held-out prompt and max_observation_tokens), more than the model's "
                          f"{positions} positions; lower 'history_length' (now {cfg.history_length}) or "
                          f"'max_observation_tokens' (now {cfg.max_observation_tokens})")
    sources = {source: sum(t.source == source for t in train) for source in ("expert", "student")}
    print(f"{len(train)} train transitions ({sources['expert']} expert, {sources['student']} student), "
          f"{sum(len(ex.answer_ids) for ex in examples)} answer tokens; longest {longest} tokens; "
          f"{len(held_out)} held-out transitions on {held_out_split}", flush=True)

    torch.manual_seed(cfg.seed)
    trainer = Trainer(model, cfg.trainer, ObjectiveConfig(estimator="nll"), LossConfig(mode="token_mean"),
                      total_steps=cfg.trainer.steps)
    losses = train_examples(trainer, examples, cfg, label="world model")
    output = Path(cfg.output_dir).expanduser()
    save_model(trainer, tokenizer, output)
    del trainer, model

    fidelity, replay, metric = measure_fidelity(output, held_out, held_out_prompts, cfg, spec)
    final = [loss for loss, _ in losses[-10:]]
    result = WorldModelResult(
        output_dir=str(output), train_transitions=sources, answer_tokens=sum(len(ex.answer_ids) for ex in examples),
        steps=len(losses), first_loss=losses[0][0], final_loss=statistics.fmean(final),
        train_time_s=sum(t for _, t in losses), held_out_split=held_out_split, fidelity=fidelity, replay=replay, metric=metric,
        data_time_s=data_time, wall_time_s=time.perf_counter() - wall_start)
    write_meta(cfg, output, result)
    print_world_model_summary(cfg, result)
    return result


def label_tasks(args: tuple[list[str], Path | None, JobModelConfig, int]) -> list[Any]:
    """One labelling process's share of the train tasks (envs.autoresearch.job_model.label_changes)."""
    from envs.autoresearch.job_model import label_changes
    from envs.autoresearch.spec import make_task, oracle

    task_ids, cache_dir, jm, seed = args
    return label_changes([make_task(t) for t in task_ids], oracle(cache_dir), jm.walks_per_task, jm.walk_turns, seed)


def run_job_model_train(cfg: WorldModelConfig) -> WorldModelResult:
    """kind job_model: labelled changes of the train tasks (their jobs run in env.num_workers
    processes) -> the ensemble -> held-out fidelity, as for a language model -> world_model.json."""
    from multiprocessing import get_context

    from envs.autoresearch.job_model import JobModel

    wall_start = time.perf_counter()
    spec = make_env_spec(cfg.env, cfg.data_dir)
    train_split, _, held_out_split, _ = train_and_eval_tasks(spec, cfg.env, eval_split=None, max_eval_tasks=None)
    tasks, workers = spec.tasks(train_split), max(cfg.env.num_workers, 1)
    jm = cfg.job_model
    print(f"labelling changes of {len(tasks)} {train_split} tasks ({jm.walks_per_task} walks of {jm.walk_turns} "
          f"changes each, jobs in {workers} processes)", flush=True)
    with get_context("spawn").Pool(workers) as processes:
        rows = [row for share in processes.map(label_tasks, [(tasks[w::workers], spec.cache_dir, jm, cfg.seed)
                                                            for w in range(workers)]) for row in share]
    held_out = held_out_transitions(cfg, spec, held_out_split)
    data_time = time.perf_counter() - wall_start
    print(f"{len(rows)} labelled changes; fitting {jm.members} members", flush=True)
    fit_start = time.perf_counter()
    model = JobModel(jm.members, jm.hidden, cfg.seed)
    first_loss, final_loss = model.fit(rows, jm.steps, jm.lr)
    fit_time = time.perf_counter() - fit_start
    output = Path(cfg.output_dir).expanduser()
    model.save(output)
    fidelity, replay, metric = measure_answerer_fidelity(spec.world_answerer(output), held_out, cfg, spec)
    result = WorldModelResult(
        output_dir=str(output), train_transitions={"changes": len(rows)}, answer_tokens=0, steps=jm.steps,
        first_loss=first_loss, final_loss=final_loss, train_time_s=fit_time, held_out_split=held_out_split,
        fidelity=fidelity, replay=replay, metric=metric, data_time_s=data_time,
        wall_time_s=time.perf_counter() - wall_start)
    write_meta(cfg, output, result)
    print_world_model_summary(cfg, result)
    return result


def write_meta(cfg: WorldModelConfig, output: Path, result: WorldModelResult) -> None:
    """world_model.json: what the model is (its kind), the env and prompt settings it was built for, its tables."""
    meta = {"format": WORLD_MODEL_FORMAT, "kind": ANSWERER_KIND if cfg.kind == "job_model" else cfg.kind,
            "env": cfg.env.name, "env_options": cfg.env.options, "history_length": cfg.history_length,
            "max_observation_tokens": cfg.max_observation_tokens, "result": asdict(result)}
    (output / "world_model.json").write_text(json.dumps(meta, indent=2) + "\n")


def held_out_transitions(cfg: WorldModelConfig, spec: EnvSpec, split: str) -> list[Transition]:
    return player_transitions(cfg, spec, split, cfg.data.held_out_episodes, cfg.data.held_out_episodes,
                              cfg.seed + HELD_OUT_SALT)


def run_world_model_eval(cfg: WorldModelConfig) -> WorldModelResult:
    """The held-out fidelity of the world model the recipe already trained (its output_dir), measured
    again without training: world_model.json's fidelity and replay tables are rewritten."""
    from transformers import AutoTokenizer

    wall_start = time.perf_counter()
    output = Path(cfg.output_dir).expanduser()
    meta_path = output / "world_model.json"
    if not meta_path.is_file():
        raise RecipeError(f"{meta_path} not found: train the world model first "
                          f"(turnopd world-model train <this recipe>), or point output_dir at one")
    meta = json.loads(meta_path.read_text())
    spec = make_env_spec(cfg.env, cfg.data_dir)
    held_out_split = train_and_eval_tasks(spec, cfg.env, eval_split=None, max_eval_tasks=None)[2]
    held_out = held_out_transitions(cfg, spec, held_out_split)
    data_time = time.perf_counter() - wall_start
    if meta.get("kind") == ANSWERER_KIND:
        fidelity, replay, metric = measure_answerer_fidelity(spec.world_answerer(output), held_out, cfg, spec)
    else:
        tokenizer = AutoTokenizer.from_pretrained(output)
        prompts = [chat_prompt_ids(tokenizer, transition_prompt(t)) for t in held_out]
        fidelity, replay, metric = measure_fidelity(output, held_out, prompts, cfg, spec)
    trained = meta["result"]
    result = WorldModelResult(
        output_dir=str(output), train_transitions=trained["train_transitions"],
        answer_tokens=trained["answer_tokens"], steps=trained["steps"], first_loss=trained["first_loss"],
        final_loss=trained["final_loss"], train_time_s=trained["train_time_s"], held_out_split=held_out_split,
        fidelity=fidelity, replay=replay, metric=metric, data_time_s=data_time, wall_time_s=time.perf_counter() - wall_start)
    meta["result"] = asdict(result)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print_world_model_summary(cfg, result)
    return result


def print_world_model_summary(cfg: WorldModelConfig, r: WorldModelResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{cfg.name}[/]: {r.steps} steps on {sum(r.train_transitions.values())} transitions "
                  f"in {r.train_time_s:.0f} s; loss {r.first_loss:.3f} -> {r.final_loss:.3f}")
    table = Table(title=f"held-out fidelity on {r.held_out_split}: greedy answers against the real env's "
                        "(exact match and token-F1 of the observation, status accuracy, calibration)")
    for column in ("", "n", "exact", "token-F1", "status", "ECE done", "ECE won"):
        table.add_column(column, justify="right" if column else "left")
    for key, row in r.fidelity.items():
        ece = ["-" if v is None else f"{v:.3f}" for v in (row.done_ece, row.won_ece)]
        table.add_row(key, str(row.transitions), f"{100 * row.exact_match:.1f}%", f"{row.token_f1:.3f}",
                      f"{100 * row.status_accuracy:.1f}%", *ece)
    console.print(table)
    replays = Table(title="held-out episodes replayed in the model (their actions, from their first observation, "
                          "greedy) against the real endings")
    for column in ("", "episodes", "won (env)", "won (model)", "same ending", "turns (env)", "turns (model)",
                   "no verdict"):
        replays.add_column(column, justify="right" if column else "left")
    for key, row in r.replay.items():
        replays.add_row(key, str(row.episodes), f"{100 * row.won_real:.1f}%", f"{100 * row.won_replayed:.1f}%",
                        f"{100 * row.same_ending:.1f}%", f"{row.turns_real:.1f}", f"{row.turns_replayed:.1f}",
                        str(row.no_verdict))
    console.print(replays)
    if r.metric:
        metrics = Table(title="held-out scored changes: the metric the greedy answer writes against the env's, and "
                              "P(the change helps) (the share of sampled answers that say it was kept) against "
                              f"whether it was ({HELPS_ECE_BINS} ECE bins)")
        for column in ("", "changes", "helped", "metric written", "metric MAE", "AUROC helps", "ECE helps"):
            metrics.add_column(column, justify="right" if column else "left")
        for key, m in r.metric.items():
            metrics.add_row(key, str(m.changes), str(m.helped), str(m.parsed),
                            "-" if m.metric_mae is None else f"{m.metric_mae:.2f}",
                            "-" if m.helps_auroc is None else f"{m.helps_auroc:.3f}", f"{m.helps_ece:.3f}")
        console.print(metrics)
    console.print(f"world model: {r.output_dir} (world_model.json holds these tables); wall clock {r.wall_time_s:.0f} s "
                  f"(model build and episodes {r.data_time_s:.0f} s)")
