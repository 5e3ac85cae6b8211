"""Recipes: OmegaConf YAML validated against these dataclasses.

A recipe may extend others with `defaults: [base.yaml, ...]` (paths relative to the recipe; merged
in order, then the recipe, then command-line `key=value` overrides). Unknown keys, wrong types and
values outside a field's allowed set fail at once with a RecipeError naming key, value and what is
allowed. Allowed sets live in field metadata: `choices` (a tuple), `registry` (the kind of the
registry whose names are allowed: the algorithm layer's estimators, loss modes, alpha schedules and
depth modes and the core's trackers, which `validate` looks up itself, and the backend registries
above this layer, env, policy backend, model preparation, pipeline mode, which its caller
turnopd.orchestration.recipe passes; a list field names each at most once) and `range` (inclusive
numeric bounds, None = unbounded).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from turnopd.algorithm.judge import JUDGES, MEMORY_MODES
from turnopd.algorithm.mixture import mixture_episodes
from turnopd.core.metrics import WORK_UNITS
from turnopd.core.registry import Registry
from turnopd.core.tracking import TRACKERS, TRACKING_EXTRA, TrackerSettings


class RecipeError(ValueError):
    """A recipe that cannot run: names the key, the value and what is allowed."""


def _choices(*names: str) -> dict[str, Any]:
    return {"choices": names}


def _range(lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    return {"range": (lo, hi)}


def _registered(kind: str) -> dict[str, Any]:
    """The field names an entry of the registry `kind` (checked by `validate`)."""
    return {"registry": kind}


class Section:
    """A recipe section. `check` holds the section's cross-field rules, those a per-field check cannot
    see (a rule spanning sections is the section's whose key its message names); check_consistency
    runs every section's. The rules that need the backends' registries are turnopd.orchestration.recipe's."""

    def check(self, run: RunConfig) -> None:
        """Raise a RecipeError naming this section's key when `run` breaks one of its rules."""


def algorithm_registries() -> dict[str, Registry]:
    """The registries of the algorithm layer, by kind. Imported when a recipe is validated, not with
    this module: env workers unpickle an EnvConfig, and should not load torch for it."""
    from turnopd.algorithm.controllers import ALPHA_SCHEDULES, DEPTH_MODES
    from turnopd.algorithm.familiarity import FAMILIARITY_MODES, FAMILIARITY_SIGNALS
    from turnopd.algorithm.objective import ADVANTAGES, ESTIMATORS, TOKEN_WEIGHT_MODES

    return {r.kind: r for r in (ESTIMATORS, TOKEN_WEIGHT_MODES, ALPHA_SCHEDULES, DEPTH_MODES, FAMILIARITY_MODES,
                                FAMILIARITY_SIGNALS, ADVANTAGES)}


@dataclass
class RayEnvConfig:
    """Where env.pool=ray runs the env workers, each a Ray actor (envs.ray_pool, docs/cluster.md)."""

    # the cluster to join: "auto" (the one this machine is a node of), "ray://HOST:10001" (Ray Client)
    # or the head's "HOST:6379"; None: a local cluster started for the pool and stopped with it
    address: str | None = None
    num_cpus: float = field(default=1.0, metadata=_range(0.0))  # each actor's CPU request
    resources: dict[str, float] = field(default_factory=dict)  # each actor's custom resources, e.g. {sandbox: 1}
    # how long the pool waits for its actors to be placed and started (an autoscaler may add nodes meanwhile)
    start_timeout_s: float = field(default=120.0, metadata=_range(1.0))


@dataclass
class EnvConfig(Section):
    name: str = field(default="alfworld", metadata=_registered("env"))
    train_split: str = "train"
    eval_split: str = "valid_unseen"  # held-out split; several joined by "+" (e.g. valid_unseen+valid_seen)
    # the horizon: the most turns an episode plays (probes and evaluations play all of them; the depth
    # controller caps training rollouts within it)
    max_turns: int = field(default=50, metadata=_range(1))
    history_length: int = field(default=2, metadata=_range(0))
    # prompt template and answer format of the env's prompt (see envs/base.py)
    template: str = "default"
    answer_format: str = field(default="think_action", metadata=_choices("think_action", "action"))
    invalid_action_penalty: float = 0.0
    num_workers: int = field(default=2, metadata=_range(1))
    step_timeout_s: float = field(default=60.0, metadata=_range(0.1))
    # a fixed wait per real reset and step, in the env worker: a fast env standing in for a costly
    # one (a remote sandbox); 0 for the env as it is
    step_latency_s: float = field(default=0.0, metadata=_range(0.0))
    # where the env workers run: processes of this node (local), Ray actors placed by `ray` (ray), or this
    # process itself (inline: for an env that costs nothing to step, e.g. prompts; no crash isolation)
    pool: str = field(default="local", metadata=_choices("local", "ray", "inline"))
    ray: RayEnvConfig = field(default_factory=RayEnvConfig)
    task_types: list[str] = field(default_factory=list)  # empty: all task types of the split
    max_tasks: int | None = None  # first N tasks of the split (after task_types), None: all
    options: dict[str, Any] = field(default_factory=dict)  # env-specific settings

    def check(self, run: RunConfig) -> None:
        if self.step_latency_s >= self.step_timeout_s:
            raise RecipeError(f"recipe key 'env.step_latency_s'={self.step_latency_s} must be below "
                              f"'env.step_timeout_s'={self.step_timeout_s}: every step would time out")
        if self.pool == "inline" and self.step_latency_s:
            raise RecipeError("recipe key 'env.step_latency_s' with env.pool=inline: inline env workers answer in "
                              "the caller's thread, so a latency would stall every episode; use env.pool=local")
        if self.pool == "ray" and importlib.util.find_spec("ray") is None:
            raise RecipeError("recipe key 'env.pool': 'ray' needs the ray package, which is not installed: "
                              "pip install 'turnopd[ray]' (or env.pool=local)")


@dataclass
class ModelConfig:
    """A student model: a Hugging Face directory or hub name, or one that `turnopd model` builds."""

    path: str = MISSING
    dtype: str = field(default="auto", metadata=_choices("auto", "float32", "bfloat16", "float16"))
    # name of a model preparation (e.g. a tiny model built from the env's text, or smollm2-135m)
    # run once and cached when `path` does not exist yet; see turnopd.models
    prepare: str | None = field(default=None, metadata=_registered("model preparation"))
    prepare_options: dict[str, Any] = field(default_factory=dict)
    # a text model that sees an env's screenshots through this glyph reader (turnopd.models.screen_reader,
    # built there by its preparation when missing): the text it reads stands for each page; None: none
    screen_reader: str | None = None


@dataclass
class LoraConfig:
    """A LoRA adapter on the student (peft): only the adapter is trained, checkpointed and synced to the
    rollout engine; the base weights stay frozen. `turnopd model merge RUN` folds it into the weights."""

    rank: int = field(default=16, metadata=_range(1))
    alpha: float = field(default=32.0, metadata=_range(0.0))
    dropout: float = field(default=0.0, metadata=_range(0.0, 1.0))
    # module names (peft's target_modules) or ["all-linear"]: every linear layer but the output head
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


@dataclass
class StudentConfig(ModelConfig, Section):
    lora: LoraConfig | None = None  # None: full fine-tuning

    def check(self, run: RunConfig) -> None:
        lora = self.lora
        if lora is not None and (not lora.target_modules or {"lm_head", "embed_tokens"} & set(lora.target_modules)):
            raise RecipeError(f"recipe key 'student.lora.target_modules': {lora.target_modules}; name the "
                              "decoder's linear layers (or all-linear): the trainer reads the output head and the "
                              "embedding as plain weights, so an adapter on them would be ignored")


@dataclass
class PolicyConfig:
    """Student generation (rollouts)."""

    backend: str = field(default="transformers", metadata=_registered("policy backend"))
    temperature: float = field(default=1.0, metadata=_range(0.0))
    top_p: float = field(default=1.0, metadata=_range(0.0, 1.0))
    max_new_tokens: int = field(default=128, metadata=_range(1))
    stop: list[str] = field(default_factory=lambda: ["</action>"])
    max_batch_size: int = field(default=32, metadata=_range(1))
    options: dict[str, Any] = field(default_factory=dict)  # backend-specific (e.g. vLLM engine args)


@dataclass
class PromptConfig(Section):
    """What the policy is shown each turn (turnopd.rollout.render, docs/chat.md). `history_block`: each
    turn one fresh user message, the env's template with its history window written in it (the paper's
    setting); `chat`: the episode is one conversation (a system prompt, the task, then each action as
    an assistant message and each observation as a user or tool message) that only grows, so the
    whole trajectory is one sequence for the student and the teacher."""

    style: str = field(default="history_block", metadata=_choices("history_block", "chat"))
    system: str | None = None  # chat: the system prompt (None: the env's, if it has one)
    # chat: the env's actions offered as a tool through the chat template's `tools=`, the answers parsed
    # as tool calls and the env's answers sent as tool messages
    tools: bool = False
    # chat: the most tokens a conversation may hold (prompt + the answer); an observation that would
    # overflow it ends the episode as truncated (None: the policy's context, policy max_model_len)
    max_context: int | None = field(default=None, metadata=_range(1))

    def check(self, run: RunConfig) -> None:
        self.check_keys(run.policy.max_new_tokens)
        if self.style == "chat" and (run.world_model.path or run.judge.by != "none"):
            raise RecipeError("recipe key 'prompt.style': chat with a world model or a judge is not built: their "
                              "prompts re-render the env's template each turn; use prompt.style=history_block")

    def check_keys(self, max_new_tokens: int) -> None:
        """The section's own rules (an SFT recipe has these alone)."""
        if self.style != "chat":
            for key, value in (("system", self.system), ("tools", self.tools), ("max_context", self.max_context)):
                if value:
                    raise RecipeError(f"recipe key 'prompt.{key}': {value!r} needs prompt.style=chat (the "
                                      "history_block style renders each turn afresh, with no system, tools or "
                                      "conversation to bound)")
            return
        if self.max_context is not None and self.max_context <= max_new_tokens:
            raise RecipeError(f"recipe key 'prompt.max_context': {self.max_context} leaves no room for a prompt "
                              f"beside policy.max_new_tokens={max_new_tokens}")


@dataclass
class ObjectiveConfig(Section):
    estimator: str = field(default="k1", metadata=_registered("estimator"))
    kind: str = "reverse"  # reverse | forward | jsd, as the estimator allows (checked by check_consistency)
    jsd_beta: float = field(default=0.5, metadata=_range(0.0, 1.0))
    topk: int = field(default=20, metadata=_range(1))
    # PPO clip of the estimator's importance ratio, [1 - eps, 1 + eps]; None: no clip. k1's ratio is
    # pi_theta / pi_behave (the sampling log-prob: coupled PPO), k1_decoupled's pi_theta / pi_prox (the
    # log-prob under the weights the trainer's step started from); k1_proximal's is 1 and takes none
    clip_eps: float | None = None
    # dual clip c > 1 of the same ratio: a token with a negative advantage costs at most c |A| (verl, AReaL)
    dual_clip: float | None = None
    # k1_decoupled: tokens whose behaviour weight pi_prox / pi_behave exceeds it are dropped (AReaL's
    # behav_imp_weight_cap; they still count in the loss mode's denominators); None: none dropped
    behave_weight_cap: float | None = field(default=None, metadata=_range(0.0))
    chunk_size: int = field(default=256, metadata=_range(1))
    # the outcome-reward term beside the KL: loss = sum w (l_KL + reward_weight * g), g the policy
    # gradient of the episode's group-normalised reward `advantage` (groups: trainer.group_size episodes
    # of one task), under the loss mode's weights; 0: pure OPD (no reward term computed)
    reward_weight: float = field(default=0.0, metadata=_range(0.0))
    advantage: str = field(default="grpo", metadata=_registered("advantage"))
    # whether the teachers must share the student's tokenizer: `match` (default; a teacher whose
    # tokenizer differs is refused, from the tokenizer files before any weights load) or `cross` (the
    # teacher reads each turn rendered in its own chat template and tokenizer, and its log-probs reach
    # the student's tokens through aligned text spans: turnopd.algorithm.token_alignment)
    tokenizers: str = field(default="match", metadata=_choices("match", "cross"))

    def check(self, run: RunConfig) -> None:
        if self.reward_weight > 0 and run.trainer.group_size < 2:
            raise RecipeError(f"recipe key 'objective.reward_weight': {self.reward_weight} with "
                              "trainer.group_size=1: a group-normalised advantage of a lone episode is 0; set "
                              "trainer.group_size >= 2")
        estimators = algorithm_registries()["estimator"]
        est = estimators.get(self.estimator)
        if not est.uses_teacher:
            raise RecipeError(f"recipe key 'objective.estimator': {self.estimator!r} ignores the teacher (supervised "
                              "fine-tuning on the batch's own tokens, what `turnopd sft` trains with); distillation "
                              f"needs one of {', '.join(n for n in estimators.names() if estimators.get(n).uses_teacher)}")
        if self.kind not in est.kinds:
            raise RecipeError(f"recipe key 'objective.kind': {self.kind!r} is not allowed with estimator "
                              f"{self.estimator}; allowed: {', '.join(est.kinds)} (topk and full take reverse, "
                              "forward or jsd)")
        if self.kind == "jsd" and not 0.0 < self.jsd_beta < 1.0:
            raise RecipeError(f"recipe key 'objective.jsd_beta': {self.jsd_beta}; kind=jsd needs 0 < beta < 1")
        self._check_ratio(est, ", ".join(n for n in estimators.names() if estimators.get(n).needs_sampling_logprobs))
        self._check_tokenizers(est, run)

    def _check_tokenizers(self, est: Any, run: RunConfig) -> None:
        """The estimators a teacher of another tokenizer allows: the sampled-token ones and topk_cross."""
        if est.needs_vocab_map:
            if self.tokenizers == "match":
                raise RecipeError(f"recipe key 'objective.estimator': {self.estimator} maps a teacher's top-k from its "
                                  "own vocabulary, which needs objective.tokenizers=cross; with one tokenizer use topk")
            if len({str(run.teachers.get(share.env.name)) for share in env_mixture(run)}) > 1:
                raise RecipeError(f"recipe key 'objective.estimator': {self.estimator} maps one teacher's vocabulary "
                                  "into the student's, and this multi-env run (envs) has several teachers; use k1, "
                                  "k1_proximal, k1_decoupled or k3")
        elif self.tokenizers == "cross" and est.needs_teacher_topk:
            raise RecipeError(f"recipe key 'objective.tokenizers': cross with estimator {self.estimator}, which reads "
                              "the teacher's top-k ids as the student's; across tokenizers use topk_cross (exact on the "
                              "tokens whose text both vocabularies hold, ULD's sorted-probability distance for the rest)")
        elif self.tokenizers == "cross" and est.needs_teacher_model:
            raise RecipeError(f"recipe key 'objective.tokenizers': cross with estimator {self.estimator}: the teacher in "
                              "the training process reads the student's token ids, and its head's rows are another "
                              "vocabulary's; use topk_cross (the teacher's top-k over its own vocabulary, mapped) or a "
                              "sampled-token estimator (k1, k1_proximal, k1_decoupled, k3)")

    def _check_ratio(self, est: Any, with_ratio: str) -> None:
        """The keys that act on the estimator's importance ratio or read its sampled log-prob."""
        if self.dual_clip is not None and (self.dual_clip <= 1 or not est.needs_sampling_logprobs):
            raise RecipeError(f"recipe key 'objective.dual_clip': {self.dual_clip}; it needs c > 1 and an estimator "
                              f"with an importance ratio ({with_ratio}), got {self.estimator}")
        if self.behave_weight_cap is not None and not est.has_behaviour_weight:
            raise RecipeError(f"recipe key 'objective.behave_weight_cap': {self.behave_weight_cap}; it caps the "
                              f"behaviour weight pi_prox / pi_behave of k1_decoupled, and {self.estimator} has none")
        if self.reward_weight > 0 and est.needs_teacher_model:
            raise RecipeError(f"recipe key 'objective.reward_weight': {self.reward_weight} with estimator "
                              f"{self.estimator}, which reads hidden states, not the sampled token's log-prob the "
                              "reward term needs; use k1, k1_proximal, k1_decoupled, k3 or topk")
        if self.clip_eps is not None and not est.needs_sampling_logprobs:
            raise RecipeError(f"recipe key 'objective.clip_eps': {self.clip_eps}; it clips the importance ratio of "
                              f"an estimator that has one ({with_ratio}), and {self.estimator} has none")


@dataclass
class LossConfig(Section):
    mode: str = field(default="progressive", metadata=_registered("loss mode"))
    # the k of loss.mode constant and constant_token_mean, in turns (AsyncWebRL's step_adv_const_length
    # counts steps: 10 in its configs)
    constant_k: float | None = None
    alpha_schedule: str = field(default="linear", metadata=_registered("alpha schedule"))
    alpha_start: float = field(default=0.0, metadata=_range(0.0, 1.0))
    alpha_end: float = field(default=1.0, metadata=_range(0.0, 1.0))

    def check(self, run: RunConfig) -> None:
        if self.mode in ("constant", "constant_token_mean") and (self.constant_k is None or self.constant_k <= 0):
            raise RecipeError(f"recipe key 'loss.constant_k': {self.constant_k!r}; loss.mode={self.mode} needs "
                              "constant_k > 0 (in turns)")
        if self.alpha_schedule != "constant" and self.alpha_end <= self.alpha_start:
            raise RecipeError(f"recipe keys 'loss.alpha_start'={self.alpha_start} and 'loss.alpha_end'="
                              f"{self.alpha_end}: need alpha_end > alpha_start")


@dataclass
class FamiliarityConfig(Section):
    """Where the teacher is guessing (turnopd.algorithm.familiarity): every run logs the signals per
    turn (unless `signals` is false); `mode` weight or gate also scales each turn's KL weight by its `signal`."""

    mode: str = field(default="none", metadata=_registered("familiarity mode"))
    signal: str = field(default="context_logprob", metadata=_registered("familiarity signal"))
    # in the signal's own units; weight and gate need it (`turnopd teacher audit` prints its quantiles)
    threshold: float | None = None
    temperature: float = field(default=1.0, metadata=_range(1e-6))  # weight: the sigmoid's scale
    # teacher top-k scored for action_entropy from a backend whose scores carry no entropy (vllm, vllm_server)
    topk: int = field(default=0, metadata=_range(0))
    # false: an in-process teacher (objective.estimator full) skips the signals, whose context_logprob reads
    # its head out at every context token (most of the tokens of one-turn prompts); mode none only
    signals: bool = True

    def check(self, run: RunConfig) -> None:
        if self.mode != "none" and not self.signals:
            raise RecipeError(f"recipe key 'familiarity.signals': false with familiarity.mode={self.mode}, which "
                              f"scales each turn's weight by its {self.signal}: the signals are needed")
        if self.mode != "none" and self.threshold is None:
            raise RecipeError(f"recipe key 'familiarity.threshold': familiarity.mode={self.mode} needs a threshold "
                              f"in the units of familiarity.signal={self.signal} (`turnopd teacher audit RECIPE` "
                              "prints its quantiles on student states)")


@dataclass
class DepthConfig(Section):
    mode: str = field(default="adaptive", metadata=_registered("depth mode"))
    h_min: int = field(default=2, metadata=_range(1))  # the horizon (H_max) is env.max_turns
    quantile: float = field(default=0.8, metadata=_range(0.0, 1.0))
    min_successes: int = field(default=8, metadata=_range(0))
    ema: float = field(default=0.3, metadata=_range(0.0, 1.0))
    warmup_steps: int = field(default=3, metadata=_range(0))
    probe_every: int = field(default=8, metadata=_range(1))
    num_probes: int | None = field(default=None, metadata=_range(1))  # None: a probe step plays episodes_per_step
    # continuous probing: this share of every step's episodes are probes (None: periodic probe steps)
    probe_fraction: float | None = field(default=None, metadata=_range(0.0, 1.0))
    # H_cov when fewer than min_successes probes succeeded: previous (the last measured), h_max (the
    # horizon, env.max_turns), h_eff
    coverage_fallback: str = field(default="previous", metadata=_choices("previous", "h_max", "h_eff"))
    fixed_cap: int | None = None
    curriculum_interval: int = field(default=1, metadata=_range(1))
    # the number the curriculum gives a run's first step, cap = 1 + (step + it) // interval: 0 (TurnOPD's
    # optimizer steps) or 1 (TCOD's explorer steps, batch_id = explore_step_num + 1)
    curriculum_first_step: int = field(default=0, metadata=_choices(0, 1))

    def check(self, run: RunConfig) -> None:
        # the shortest horizon of the run's envs (each env's depth controller caps within its own)
        horizon = min(share.env.max_turns for share in env_mixture(run))
        episodes = run.trainer.episodes_per_step
        if self.h_min > horizon:
            raise RecipeError(f"recipe key 'depth.h_min'={self.h_min} exceeds the horizon 'env.max_turns'={horizon}; "
                              f"set depth.h_min={horizon} or lower")
        if self.ema == 0:
            raise RecipeError("recipe key 'depth.ema': 0 would never move the cap; need 0 < ema <= 1")
        if self.mode == "fixed" and (self.fixed_cap is None or not 1 <= self.fixed_cap <= horizon):
            raise RecipeError(f"recipe key 'depth.fixed_cap': {self.fixed_cap!r}; depth.mode=fixed needs 1 <= "
                              f"fixed_cap <= env.max_turns={horizon}")
        if self.probe_fraction is not None and round(self.probe_fraction * episodes) < 1:
            raise RecipeError(f"recipe key 'depth.probe_fraction': {self.probe_fraction} of "
                              f"trainer.episodes_per_step={episodes} rounds to no probe a step; raise it or the episodes")


@dataclass
class BudgetConfig:
    """A training budget: the run ends after the step at which its cumulative `unit` reaches `amount`
    (with the final evaluation and checkpoint of a last step): the training clock in seconds
    (train_time_s) or a work measure (env_steps, tokens_generated, tokens_trained), which does not
    depend on the machine. In env_steps and tokens_generated the last steps play only the episodes
    the budget leaves room for (turnopd.orchestration.pipeline.plan.within_budget), so a run ends at
    most one episode's work past it; the clock and tokens_trained cannot be bounded ahead: the step
    that crosses them is trained whole (docs/recipes.md, Training budgets)."""

    unit: str = field(default="env_steps", metadata=_choices(*WORK_UNITS))
    amount: float = 0.0


@dataclass
class TrainerConfig(Section):
    steps: int = field(default=100, metadata=_range(1))  # optimizer steps K
    episodes_per_step: int = field(default=16, metadata=_range(1))
    # episodes of one task in a step's batch (a pool wave's): GRPO's group, what objective.reward_weight's
    # advantage and world_model.denoise=anchor_weight compare within; 1: every episode a task of its own
    group_size: int = field(default=1, metadata=_range(1))
    lr: float = field(default=1e-6, metadata=_range(0.0))
    lr_schedule: str = field(default="constant", metadata=_choices("constant", "cosine", "linear"))
    lr_warmup_steps: int = field(default=0, metadata=_range(0))
    weight_decay: float = field(default=0.0, metadata=_range(0.0))
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = field(default=1.0, metadata=_range(0.0))
    micro_batch_tokens: int = field(default=4096, metadata=_range(1))
    zero_stage: int = field(default=0, metadata=_range(0, 3))
    # extra DeepSpeed config: a mapping merged over the generated one, or a path to a JSON file
    deepspeed: Any = None
    activation_checkpointing: bool = False
    # rows of a micro-batch that begin alike run their common prefix once (student and in-process teacher)
    shared_prefix: bool = True
    dtype: str = field(default="auto", metadata=_choices("auto", "float32", "bfloat16"))
    max_bad_steps: int = field(default=3, metadata=_range(1))  # NaN/inf steps in a row before stopping
    # an optimizer update per this many turn rows (a turn's action tokens, TCOD's unit: its
    # train_batch_size 64): a step's batch is trained in consecutive updates of at most this many rows,
    # in batch order; None: one update on the step's whole batch
    turn_rows_per_update: int | None = field(default=None, metadata=_range(1))
    budget: BudgetConfig | None = None  # None: train all `steps`

    def check(self, run: RunConfig) -> None:
        if self.budget is not None and not self.budget.amount > 0:
            raise RecipeError(f"recipe key 'trainer.budget.amount': {self.budget.amount}; a budget of "
                              f"{self.budget.unit} needs an amount > 0 (or trainer.budget: null for all trainer.steps)")
        if self.episodes_per_step % self.group_size:
            raise RecipeError(f"recipe key 'trainer.group_size': {self.group_size} does not divide "
                              f"trainer.episodes_per_step={self.episodes_per_step}: a step's batch is whole groups "
                              "of one task each")
        if self.turn_rows_per_update is not None and (self.lr_schedule != "constant" or self.lr_warmup_steps > 0):
            raise RecipeError(f"recipe key 'trainer.turn_rows_per_update': {self.turn_rows_per_update} with "
                              f"trainer.lr_schedule={self.lr_schedule} and lr_warmup_steps={self.lr_warmup_steps}; "
                              "the schedule counts optimizer updates, whose number per step grows with the turns "
                              "played: use a constant lr without warm-up")
        if run.student.lora is not None and self.zero_stage == 3:
            raise RecipeError("recipe key 'trainer.zero_stage': 3 with student.lora; a LoRA student trains under "
                              "ZeRO 0-2 (its adapter is small: partitioning the frozen base buys nothing)")


@dataclass
class EvalConfig:
    every: int = field(default=0, metadata=_range(0))  # 0: only at start and end
    split: str | None = None  # None: env.eval_split
    k: int = field(default=1, metadata=_range(1))  # Avg@k; k = 1 is greedy
    final_k: int | None = field(default=None, metadata=_range(2))  # also a sampled Avg@final_k at the end
    temperature: float = field(default=1.0, metadata=_range(0.0))  # sampling temperature for k > 1
    max_tasks: int | None = None  # evaluate the first N tasks of the split, None: all
    at_start: bool = True
    teacher: bool = False  # also evaluate the teacher on the same tasks at the start (the ceiling)


@dataclass
class CheckpointConfig:
    every: int = field(default=0, metadata=_range(0))  # 0: only at the end
    keep_last: int = field(default=2, metadata=_range(1))
    # a stop signal (Ctrl-C, a scheduler's SIGTERM) checkpoints the steps done before the run ends
    on_stop: bool = True


@dataclass
class PipelineConfig:
    """Where a step's trajectories come from (turnopd.orchestration.pipeline): played in the training process
    (sync), or by a generator process overlapping training (one_step_off, pool)."""

    mode: str = field(default="sync", metadata=_registered("pipeline mode"))
    # pool: the most weight versions (optimizer steps) a trained trajectory may lag the trainer
    max_staleness: int = field(default=1, metadata=_range(0))
    # pool: episodes per wave (None: a step's); one that divides a step's keeps waves in line with steps
    wave_episodes: int | None = field(default=None, metadata=_range(1))
    max_generator_restarts: int = field(default=2, metadata=_range(0))  # then a dead generator ends the run


@dataclass
class WorldModelRolloutConfig(Section):
    """World-model rollouts (turnopd.rollout.world_model_pool): a model written by `turnopd world-model
    train` answers the env steps of most training episodes; null `path`: every episode plays the real
    env. The keys (verdicts, corrections, anchor groups): docs/world-models.md, "In distillation"."""

    path: str | None = None
    real_fraction: float = field(default=0.25, metadata=_range(0.0, 1.0))
    verdict: str = field(default="last_turn", metadata=_choices("last_turn", "replay", "twin"))
    samples: int = field(default=1, metadata=_range(1))
    temperature: float = field(default=1.0, metadata=_range(0.0))
    variance_floor: float = field(default=0.1, metadata=_range(1e-6))
    debias: str = field(default="ppi", metadata=_choices("ppi", "isotonic"))
    denoise: str = field(default="trajectory_variance", metadata=_choices("trajectory_variance", "anchor_weight"))
    anchor_fraction: float = field(default=0.10, metadata=_range(0.0, 1.0))  # WMRL's AnchorScheduler(fraction=0.10)
    anchor_min_groups: int = field(default=1, metadata=_range(0))  # its min_per_step=1
    anchor_max_concurrent: int | None = field(default=None, metadata=_range(0))  # its max_concurrent (None: no cap)
    # WMRL's schedule of the two corrections, for runs shorter than its (null: its constants,
    # turnopd.algorithm.world_model_corrections): isotonic stays the identity until
    # `calibration_min_pairs` (200) pairs, then refits every `calibration_refit_every` (64); the
    # anchor weight stays 1 until `anchor_warmup_groups` (32) groups, smoothed over `anchor_half_life` (64)
    calibration_min_pairs: int | None = field(default=None, metadata=_range(2))
    calibration_refit_every: int | None = field(default=None, metadata=_range(1))
    anchor_warmup_groups: int | None = field(default=None, metadata=_range(1))
    anchor_half_life: float | None = field(default=None, metadata=_range(1.0))

    @property
    def anchors(self) -> bool:
        """Whether the real episodes are WMRL's anchor groups (a WMRL correction needs them)."""
        return self.debias == "isotonic" or self.denoise == "anchor_weight"

    def check(self, run: RunConfig) -> None:
        if self.path is None:
            return
        if run.pipeline.mode != "sync":
            raise RecipeError(f"recipe key 'world_model.path' with pipeline.mode={run.pipeline.mode}: world-model "
                              "rollouts play in the training process (pipeline.mode: sync); the generator process "
                              "of the asynchronous modes does not load the world model")
        if self.anchors and self.anchor_fraction == 0 and self.anchor_min_groups == 0:
            raise RecipeError("recipe key 'world_model.anchor_fraction': 0 with anchor_min_groups=0 leaves no anchor "
                              f"group (real env) to fit debias={self.debias} / denoise={self.denoise} on; use a "
                              "share above 0")
        if not self.anchors and self.real_fraction == 0:
            raise RecipeError("recipe key 'world_model.real_fraction': 0 leaves no real training episode to measure "
                              "the world model's bias on (Online Debiasing); use a share above 0, or "
                              "world_model.path: null for real rollouts only")
        if self.denoise == "anchor_weight" and run.trainer.group_size < 2:
            raise RecipeError("recipe key 'world_model.denoise': 'anchor_weight' measures the world model's "
                              "disagreement within a group of one task, and trainer.group_size=1 makes every group "
                              "one episode; set trainer.group_size >= 2")


@dataclass
class JudgeConfig(Section):
    """Judge before you run (turnopd.rollout.judge; Rehearse, arXiv 2607.27687): in each real training
    episode the policy samples `k` candidate actions a turn (the turn's own sample, then k - 1 at
    `temperature`), a judge compares the distinct valid ones pairwise in both orders and votes only
    when both orders agree, and the candidate with the most votes runs (the first sample when it
    abstains on all). `by`: none (no judge), teacher (the recipe's teacher prompted as a judge),
    teacher_policy (the teacher's log-probability of each candidate as its own answer) or world_model
    (world_model.path's predicted metric). `memory`: what the judge reads of the run's
    earlier real attempts of the same task: none, focused (at most `memory_limit` whose change is at
    least `similarity_threshold` similar to a candidate's), full (all, the last 30), summary (a tally
    per knob). Evaluations play the student alone."""

    by: str = field(default="none", metadata=_choices("none", *JUDGES))
    k: int = field(default=4, metadata=_range(2))
    temperature: float = field(default=1.0, metadata=_range(0.0))
    memory: str = field(default="none", metadata=_choices(*MEMORY_MODES))
    similarity_threshold: float = field(default=0.5, metadata=_range(0.0, 1.0))
    memory_limit: int = field(default=5, metadata=_range(1))  # Rehearse's at most 5 lines

    def check(self, run: RunConfig) -> None:
        if self.by != "none" and run.pipeline.mode != "sync":
            raise RecipeError(f"recipe key 'judge.by': {self.by!r} with pipeline.mode={run.pipeline.mode}: the judge "
                              "decides in the training process's episodes (pipeline.mode: sync), where its teacher "
                              "or world model is loaded")
        if self.by == "world_model" and run.world_model.path is None:
            raise RecipeError("recipe key 'judge.by': 'world_model' needs a world model: set world_model.path (with "
                              "world_model.real_fraction: 1 for a judge that is the model's only use)")
        if self.by in ("world_model", "teacher_policy") and self.memory != "none":
            raise RecipeError(f"recipe key 'judge.memory': {self.memory!r} with judge.by={self.by}: its prompt (the "
                              "world model's transition, the agent's own prompt) has no place for memory lines; use "
                              "judge.by=teacher for a judge with memory")
        if self.by == "none" and self.memory != "none":
            raise RecipeError(f"recipe key 'judge.memory': {self.memory!r} with judge.by=none: there is no judge to "
                              "read it; set judge.by=teacher (the judge that reads memory lines)")


@dataclass
class RunConfig(Section):
    name: str = MISSING
    seed: int = 0
    output_dir: str = "runs"
    data_dir: str | None = None  # else $TURNOPD_DATA, else ../shared/data (see turnopd.core.data)
    env: EnvConfig = field(default_factory=EnvConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    # teacher spec per env name (path to a teachers/<task>/teacher.yaml, relative to the repo)
    teachers: dict[str, str] = field(default_factory=dict)
    # a multi-env run (empty: the one env of `env`): env name -> its share of each step's episodes
    # (`weight`, or a fixed `episodes_per_step`) and its keys of the env block (env_mixture)
    envs: dict[str, Any] = field(default_factory=dict)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    familiarity: FamiliarityConfig = field(default_factory=FamiliarityConfig)
    depth: DepthConfig = field(default_factory=DepthConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    world_model: WorldModelRolloutConfig = field(default_factory=WorldModelRolloutConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # experiment trackers beside metrics.jsonl, any of turnopd.core.tracking's (tensorboard, wandb, mlflow)
    tracking: list[str] = field(default_factory=lambda: ["tensorboard"], metadata=_registered("tracker"))
    # where they file the run: project, entity, group, tags, run_name (turnopd.core.tracking.TrackerSettings)
    tracker: TrackerSettings = field(default_factory=TrackerSettings)

    def sections(self) -> list[Section]:
        """The sections that check rules, in the order of CHECKED_SECTIONS, then the recipe itself (its
        top-level keys)."""
        return [*(getattr(self, name) for name in CHECKED_SECTIONS), self]

    def check(self, run: RunConfig) -> None:
        """The top-level keys: a teacher for each env, the mixture's shares, and the trackers' packages."""
        mixture = env_mixture(run)
        for share in mixture:
            if share.env.name not in run.teachers:
                raise RecipeError(f"recipe key 'teachers': no teacher for env {share.env.name!r}; "
                                  f"set teachers.{share.env.name}=<path to teacher.yaml>")
        if run.envs:
            check_mixture(run, mixture)
        for name in run.tracking:
            package = TRACKERS.get(name).package
            if importlib.util.find_spec(package) is None:
                raise RecipeError(f"recipe key 'tracking': {name!r} needs the {package} package, which is not "
                                  f"installed: pip install '{TRACKING_EXTRA}' (or leave {name} out of tracking)")


MIXTURE_SHARE_KEYS = ("weight", "episodes_per_step")


@dataclass(frozen=True)
class MixtureEnv:
    """One env of a run: its env block, and its share of each step's episodes (a weight or a count)."""

    env: EnvConfig
    weight: float | None = None
    episodes: int | None = None


def env_mixture(run: RunConfig) -> list[MixtureEnv]:
    """The run's envs in recipe order: the env block alone (a mixture of one, every episode), or each
    entry of `envs`: the env block with the entry's keys in place of the block's (a mapping such as
    options replaced whole), named by the entry, with its weight or episodes_per_step."""
    if not run.envs:
        return [MixtureEnv(run.env, weight=1.0)]
    base = OmegaConf.to_container(OmegaConf.structured(run.env))
    mixture = []
    for name, entry in run.envs.items():
        if not isinstance(entry, Mapping):
            raise RecipeError(f"recipe key 'envs.{name}': {entry!r} is a value; give a mapping, e.g. {{weight: 0.5}}")
        keys = dict(entry)
        weight, episodes = (keys.pop(key, None) for key in MIXTURE_SHARE_KEYS)
        try:
            env = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EnvConfig), {**base, **keys, "name": name}))
        except (OmegaConfBaseException, TypeError) as exc:
            key = getattr(exc, "full_key", None) or "?"
            raise RecipeError(f"recipe key 'envs.{name}.{key}': {(getattr(exc, 'msg', None) or str(exc)).splitlines()[0]}"
                              ) from None
        mixture.append(MixtureEnv(env, weight, episodes))
    return mixture


def mixture_counts(run: RunConfig, mixture: list[MixtureEnv]) -> list[int]:
    """Each env's episodes per step (algorithm.mixture.mixture_episodes)."""
    fixed = [share.episodes for share in mixture] if mixture[0].episodes is not None else None
    return mixture_episodes(run.trainer.episodes_per_step, run.trainer.group_size,
                            [share.weight for share in mixture], fixed)


def check_mixture(run: RunConfig, mixture: list[MixtureEnv]) -> None:
    """A multi-env recipe: every env's share given one way, whole groups summing to the step's episodes
    (and to a pool wave's), and nothing that serves one env only: a world model or the judge."""
    by_weight = mixture[0].weight is not None
    for share in mixture:
        if (share.weight is None) == (share.episodes is None) or (share.weight is not None) != by_weight:
            raise RecipeError(f"recipe key 'envs.{share.env.name}': give each env one of weight or episodes_per_step, "
                              "the same one for every env")
        key, value = ("weight", share.weight) if by_weight else ("episodes_per_step", share.episodes)
        if isinstance(value, bool) or not isinstance(value, float | int if by_weight else int) or value <= 0:
            raise RecipeError(f"recipe key 'envs.{share.env.name}.{key}': {value!r}; a share is a number > 0 "
                              "(episodes_per_step a whole one)")
    total = sum(s.weight for s in mixture) if by_weight else sum(s.episodes for s in mixture)
    if by_weight and abs(total - 1) > 1e-6:
        raise RecipeError(f"recipe key 'envs': the weights sum to {total:g}; they must sum to 1")
    if not by_weight and total != run.trainer.episodes_per_step:
        raise RecipeError(f"recipe key 'envs': episodes_per_step sum to {total}, and trainer.episodes_per_step is "
                          f"{run.trainer.episodes_per_step}; make them equal")
    for share, count in zip(mixture, mixture_counts(run, mixture), strict=True):
        if count == 0 or count % run.trainer.group_size:
            raise RecipeError(f"recipe key 'envs.{share.env.name}': {count} episodes a step; every env needs whole "
                              f"groups of trainer.group_size={run.trainer.group_size}, at least one")
        if run.depth.probe_fraction is not None and round(run.depth.probe_fraction * count) < 1:
            raise RecipeError(f"recipe key 'depth.probe_fraction': {run.depth.probe_fraction} of env "
                              f"{share.env.name}'s {count} episodes a step rounds to no probe; raise it or its share")
    if run.pipeline.mode == "pool" and run.pipeline.wave_episodes is not None:
        for share, wave in zip(mixture, mixture_waves(run, mixture), strict=True):
            if wave == 0:
                raise RecipeError(f"recipe key 'pipeline.wave_episodes': {run.pipeline.wave_episodes} gives env "
                                  f"{share.env.name!r} no whole group of trainer.group_size={run.trainer.group_size} "
                                  "a wave (each env's waves are its share of them); raise it")
    why = {"world_model.path": (run.world_model.path is not None, "a world model simulates one env"),
           "judge.by": (run.judge.by != "none", "the judge plays in one env's pool (the run's add-ons are one env's)")}
    for key, (refused, reason) in why.items():
        if refused:
            raise RecipeError(f"recipe key {key!r} with a multi-env run (envs): {reason}")


def mixture_waves(run: RunConfig, mixture: list[MixtureEnv]) -> list[int | None]:
    """Each env's episodes a pool wave: its share of pipeline.wave_episodes, apportioned in whole groups
    as its share of a step's episodes is (None when waves are a step's: each env's are then its share)."""
    if run.pipeline.wave_episodes is None:
        return [None] * len(mixture)
    steps = run.trainer.episodes_per_step
    return mixture_episodes(run.pipeline.wave_episodes, run.trainer.group_size,
                            [count / steps for count in mixture_counts(run, mixture)], None)


def env_views(run: RunConfig) -> dict[str, RunConfig]:
    """A multi-env run as each of its envs sees it, by env name: the recipe with that env's block as
    `env`, its episodes a step as trainer.episodes_per_step, its episodes a pool wave as
    pipeline.wave_episodes and no `envs` (what one env's code reads)."""
    mixture = env_mixture(run)
    shares = zip(mixture, mixture_counts(run, mixture), mixture_waves(run, mixture), strict=True)
    return {share.env.name: dataclasses.replace(run, env=share.env, envs={},
                                                trainer=dataclasses.replace(run.trainer, episodes_per_step=count),
                                                pipeline=dataclasses.replace(run.pipeline, wave_episodes=wave))
            for share, count, wave in shares}


# The sections check_consistency asks, in this order: the first rule a recipe breaks is the one named
# (the order the rules had in one function, section by section).
CHECKED_SECTIONS = ("depth", "trainer", "env", "prompt", "world_model", "judge", "objective", "loss", "familiarity", "student")


def _load_yaml_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    path = path.resolve()
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    if path in seen:
        raise RecipeError(f"recipe defaults form a cycle: {' -> '.join(map(str, (*seen, path)))}")
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # yaml syntax errors
        raise RecipeError(f"cannot parse recipe {path}: {exc}") from exc
    if not isinstance(raw, DictConfig):
        raise RecipeError(f"recipe {path} must be a mapping at the top level")
    bases = raw.pop("defaults", [])
    if isinstance(bases, str):
        bases = [bases]
    merged = OmegaConf.create()
    for base in bases:
        merged = OmegaConf.merge(merged, _load_yaml_with_defaults(path.parent / str(base), (*seen, path)))
    return OmegaConf.merge(merged, raw)


def compose(recipe: str | os.PathLike[str], overrides: Sequence[str] = ()) -> DictConfig:
    """The recipe with its defaults and overrides merged, before schema validation."""
    cfg = _load_yaml_with_defaults(Path(recipe))
    if overrides:
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise RecipeError(f"overrides must be key=value, got {bad}")
        for override in overrides:  # one at a time: a merge of a list into a mapping names no key
            try:
                cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override]))
            except TypeError:
                key = override_key(override)
                given = OmegaConf.select(OmegaConf.from_dotlist([override]), key)
                raise RecipeError(f"recipe key '{key}': override {override!r} gives a {_shape(given)} where the "
                                  f"recipe has a {_shape(OmegaConf.select(cfg, key))}") from None
    return cfg


def override_key(override: str) -> str:
    """The dotted key of a `key=value` override."""
    return override.split("=", 1)[0].strip()


def _shape(node: Any) -> str:
    return "section" if isinstance(node, DictConfig) else "list" if isinstance(node, ListConfig) else "value"


def _check_allowed(obj: Any, registries: Mapping[str, Registry], prefix: str = "") -> None:
    """Walk the dataclass tree and enforce the `choices`, `registry` and `range` metadata."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_allowed(value, registries, key + ".")
            continue
        choices = f.metadata.get("choices")
        kind = f.metadata.get("registry")
        if kind is not None:
            if kind not in registries:
                raise TypeError(f"recipe key '{key}' names a registered {kind}: validate() needs that registry "
                                "(turnopd.orchestration.recipe passes them all)")
            choices = registries[kind].names
        if choices is not None and value is not None:
            allowed = choices() if callable(choices) else choices
            items = value if isinstance(value, list) else [value]  # a list field names several
            for item in items:
                if item not in allowed:
                    raise RecipeError(f"recipe key '{key}': {item!r} is not allowed; allowed: {', '.join(map(str, allowed))}")
            twice = sorted({item for item in items if items.count(item) > 1})
            if twice:
                raise RecipeError(f"recipe key '{key}': {', '.join(map(repr, twice))} named twice")
        bounds = f.metadata.get("range")
        if bounds is not None and value is not None:
            lo, hi = bounds
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise RecipeError(f"recipe key '{key}': {value!r} is out of range "
                                  f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]")


def check_consistency(cfg: RunConfig) -> None:
    """Cross-field rules of a distillation recipe that a per-field check cannot see: each section's own
    (Section.check; those that need the backends' registries are turnopd.orchestration.recipe's)."""
    for section in cfg.sections():
        section.check(cfg)


def mismatched_shape(cfg: Any, schema: type, prefix: str = "") -> str | None:
    """A one-line error for the first key of `cfg` whose shape is not its schema's: a plain value or a
    list where a section is expected (`student=Qwen/...`), a mapping where a list is. OmegaConf's merge
    error names no key for these."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        value = cfg.get(f.name) if isinstance(cfg, DictConfig) else None
        kinds = (hints[f.name], *typing.get_args(hints[f.name]))
        section = next((t for t in kinds if dataclasses.is_dataclass(t)), None)
        key = f"{prefix}{f.name}"
        if value is None:
            continue
        if section is not None and not isinstance(value, DictConfig):
            fields = [f.name for f in dataclasses.fields(section)]
            return (f"recipe key '{key}': {value!r} is a value, and '{key}' is a section of keys ({', '.join(fields)}); "
                    f"set one of them, e.g. {key}.{fields[0]}={value}")
        if isinstance(value, DictConfig) and any(typing.get_origin(t) in (list, tuple) for t in kinds):
            return f"recipe key '{key}': a mapping where a list is expected, e.g. {key}=[a,b]"
        if section is not None and (inner := mismatched_shape(value, section, f"{key}.")):
            return inner
    return None


def validate(cfg: DictConfig, schema: type = RunConfig,
             checks: Sequence[Callable[[Any], None]] = (check_consistency,),
             registries: Mapping[str, Registry] | None = None) -> Any:
    """Validate a composed recipe against a dataclass schema (RunConfig by default); returns the
    typed object. `registries`: kind -> Registry for the fields that name a backend."""
    if schema is RunConfig and OmegaConf.select(cfg, "depth.h_max") is not None:
        raise RecipeError("recipe key 'depth.h_max': removed; the horizon is one setting, env.max_turns (the "
                          "depth controller caps rollouts within it): set env.max_turns instead")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise RecipeError(f"recipe keys missing a value: {', '.join(missing)}")
        run = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, TypeError) as exc:  # TypeError: containers of different kinds merged
        key = getattr(exc, "full_key", None)
        if not key and (mismatch := mismatched_shape(cfg, schema)):
            raise RecipeError(mismatch) from None
        msg = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
        raise RecipeError(f"recipe key '{key}': {msg}" if key else f"recipe: {msg}") from None
    allowed = {**algorithm_registries(), TRACKERS.kind: TRACKERS, **(registries or {})}
    _check_allowed(run, allowed)
    for share in env_mixture(run) if isinstance(run, RunConfig) and run.envs else ():
        _check_allowed(share.env, allowed, f"envs.{share.env.name}.")
    for check in checks:
        check(run)
    return run


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def differing_keys(saved: Mapping[str, Any], now: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> list[str]:
    """The top-level keys whose values differ between two configs, sorted; a key missing from `saved`
    (a section added since it was written) reads as its `defaults` value."""
    defaults = defaults or {}
    return sorted(k for k in set(saved) | set(now) if saved.get(k, defaults.get(k)) != now.get(k))

