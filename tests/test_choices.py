"""Every value of every registered recipe choice either runs (2 real distillation steps of the tiny
ALFWorld models, through `turnopd distill`) or is refused before any heavy work, by a message that
names the key, the value and why. A choice registered without a row here fails
`test_every_registered_choice_is_run_or_refused`."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import child_env, loop_models
from turnopd.config import RecipeError, algorithm_registries
from turnopd.core.metrics import read_metrics
from turnopd.orchestration.preflight import check_setup
from turnopd.orchestration.recipe import BACKEND_REGISTRIES, load_recipe

HAS_VLLM = importlib.util.find_spec("vllm") is not None

RECIPE = """
name: choices
depth: {{warmup_steps: 1, probe_every: 1, min_successes: 1, fixed_cap: 2}}
trainer: {{steps: 2, episodes_per_step: 2, lr: 1.0e-3}}
eval: {{max_tasks: 1, at_start: false}}
"""

# registry kind -> the choices that are recipe keys (the list; env and model preparation are
# exercised by the env and model tests)
CHOICE_KEYS = {"estimator": "objective.estimator", "loss mode": "loss.mode", "alpha schedule": "loss.alpha_schedule",
               "depth mode": "depth.mode", "pipeline mode": "pipeline.mode", "policy backend": "policy.backend",
               "teacher backend": "teachers.<env> spec backend", "advantage": "objective.advantage"}

# Runs: (id, overrides, what the run covers {kind: name}). Each row is 2 steps; together they cover
# every name that runs here. alpha schedules act through the progressive loss.
RUNS = [
    ("k1-progressive-linear-adaptive-sync", [], {"estimator": "k1", "loss mode": "progressive",
                                                 "alpha schedule": "linear", "depth mode": "adaptive",
                                                 "pipeline mode": "sync", "policy backend": "transformers",
                                                 "teacher backend": "transformers"}),
    ("k3-cosine-fixed", ["objective.estimator=k3", "loss.alpha_schedule=cosine", "depth.mode=fixed"],
     {"estimator": "k3", "alpha schedule": "cosine", "depth mode": "fixed"}),
    ("topk-step-curriculum", ["objective.estimator=topk", "objective.topk=5", "loss.alpha_schedule=step",
                              "depth.mode=curriculum"],
     {"estimator": "topk", "alpha schedule": "step", "depth mode": "curriculum"}),
    ("full-constant-full", ["objective.estimator=full", "loss.alpha_schedule=constant", "loss.alpha_start=0.3",
                            "depth.mode=full"],
     {"estimator": "full", "alpha schedule": "constant", "depth mode": "full"}),
    ("one_step_off-token_mean", ["pipeline.mode=one_step_off", "objective.clip_eps=0.2", "loss.mode=token_mean"],
     {"pipeline mode": "one_step_off", "loss mode": "token_mean"}),
    ("pool-trajectory", ["pipeline.mode=pool", "objective.clip_eps=0.2", "loss.mode=trajectory"],
     {"pipeline mode": "pool", "loss mode": "trajectory"}),
    ("turn", ["loss.mode=turn"], {"loss mode": "turn"}),
    ("token", ["loss.mode=token"], {"loss mode": "token"}),
    ("sequence", ["loss.mode=sequence"], {"loss mode": "sequence"}),
    ("constant", ["loss.mode=constant", "loss.constant_k=8"], {"loss mode": "constant"}),
    ("constant_token_mean", ["loss.mode=constant_token_mean", "loss.constant_k=10"], {"loss mode": "constant_token_mean"}),
    # TCOD's batching: an update per 2 turn rows, so each step takes several, k1_decoupled's pi_prox from
    # the forward before the first
    ("turn_row_mean-k1_decoupled-rows", ["loss.mode=turn_row_mean", "objective.estimator=k1_decoupled",
                                         "objective.clip_eps=0.2", "objective.dual_clip=3",
                                         "objective.behave_weight_cap=5", "trainer.turn_rows_per_update=2"],
     {"loss mode": "turn_row_mean", "estimator": "k1_decoupled"}),
    ("pool-k1_proximal", ["pipeline.mode=pool", "pipeline.max_staleness=2", "objective.estimator=k1_proximal"],
     {"estimator": "k1_proximal"}),
    # the outcome-reward term beside the KL: groups of 2 episodes of one task, their GRPO advantage
    ("grpo-reward", ["objective.reward_weight=0.5", "trainer.group_size=2"], {"advantage": "grpo"}),
    # not a registry: continuous probes, half of each step's episodes, the H_eff-only coverage fallback
    ("continuous-probes", ["depth.probe_fraction=0.5", "depth.coverage_fallback=h_eff"], {}),
    # not a registry: each episode one conversation (docs/chat.md), in every pipeline
    ("chat-sync", ["prompt.style=chat"], {}),
    ("chat-one_step_off", ["prompt.style=chat", "pipeline.mode=one_step_off", "objective.clip_eps=0.2"], {}),
    ("chat-pool", ["prompt.style=chat", "pipeline.mode=pool", "objective.clip_eps=0.2"], {}),
    # not a registry: a teacher read in its own tokens and template (objective.tokenizers=cross; here its
    # tokenizer is the student's, so the alignment is one token a span: tests/test_token_alignment.py)
    ("cross-tokenizers-chat-k3", ["objective.tokenizers=cross", "prompt.style=chat", "objective.estimator=k3"], {}),
    ("cross-tokenizers-pool", ["objective.tokenizers=cross", "pipeline.mode=pool", "objective.clip_eps=0.2"], {}),
    ("cross-tokenizers-topk_cross", ["objective.tokenizers=cross", "objective.estimator=topk_cross",
                                     "objective.topk=5"], {"estimator": "topk_cross"}),
]

# Refusals checked by validation or the pre-flight checks: (the choice refused, or None for a rule
# about other keys; overrides; teacher spec backend; message).
REFUSED = [
    (("estimator", "nll"), ["objective.estimator=nll"], None,
     "recipe key 'objective.estimator': 'nll' ignores the teacher (supervised fine-tuning on the batch's own "
     "tokens, what `turnopd sft` trains with); distillation needs one of full, k1, k1_decoupled, k1_proximal, k3, topk, topk_cross"),
    (None, ["loss.mode=constant"], None, "recipe key 'loss.constant_k': None; loss.mode=constant needs constant_k > 0"),
    (None, ["pipeline.mode=pool"], None, "recipe key 'objective.clip_eps': None; pipeline.mode=pool trains on tokens "
                                   "sampled by older weights, so the k1 importance ratio needs a clip (e.g. 0.2)"),
    (None, ["objective.kind=forward"], None, "recipe key 'objective.kind': 'forward' is not allowed with estimator k1; "
                                       "allowed: reverse (topk and full take reverse, forward or jsd)"),
    (None, ["objective.estimator=k3", "objective.clip_eps=0.2"], None,
     "recipe key 'objective.clip_eps': 0.2; it clips the importance ratio of an estimator that has one (k1, "
     "k1_decoupled), and k3 has none"),
    (None, ["objective.estimator=full"], "vllm_server",
     "recipe key 'objective.estimator': 'full' with teacher spec {spec}: full needs the teacher's model in the "
     "training process, which the vllm_server backend does not give; use backend transformers, or estimator k1, "
     "k3 or topk"),
    (None, ["objective.tokenizers=cross", "objective.estimator=topk"], None,
     "recipe key 'objective.tokenizers': cross with estimator topk, which reads the teacher's top-k ids as the "
     "student's; across tokenizers use topk_cross"),
    (None, ["objective.tokenizers=cross", "objective.estimator=full"], None,
     "recipe key 'objective.tokenizers': cross with estimator full: the teacher in the training process reads the "
     "student's token ids"),
    (None, ["objective.estimator=topk_cross"], None,
     "recipe key 'objective.estimator': topk_cross maps a teacher's top-k from its own vocabulary, which needs "
     "objective.tokenizers=cross; with one tokenizer use topk"),
    (None, ["objective.estimator=topk", "objective.topk=50"], "vllm_server",
     "recipe key 'objective.topk': 50 > the vllm_server teacher's max_logprobs 20 (teacher spec {spec}); lower "
     "objective.topk or raise options.max_logprobs in the spec"),
]
# Refused here only where vLLM is not installed (they run in the vLLM venv, test_vllm_choices_run).
REFUSED_WITHOUT_VLLM = [
    (("policy backend", "vllm"), ["policy.backend=vllm"], None,
     "recipe key 'policy.backend': 'vllm' needs vLLM, which is not installed here"),
    (("teacher backend", "vllm"), [], "vllm", "teacher spec {spec}: backend vllm needs vLLM, which is not installed here"),
]
VLLM_RUNS = [  # (id, overrides, teacher spec backend, covers)
    ("vllm-policy", ["policy.backend=vllm"], "transformers",
     {"policy backend": "vllm"}),
    ("vllm-teacher-topk", ["objective.estimator=topk", "objective.topk=5"], "vllm", {"teacher backend": "vllm"}),
    ("vllm-server-teacher", [], "vllm_server", {"teacher backend": "vllm_server"}),
    ("vllm-chat", ["policy.backend=vllm", "prompt.style=chat"], "vllm_server", {}),
    ("vllm-server-teacher-cross", ["objective.tokenizers=cross"], "vllm_server", {}),
]


def _registered() -> dict[str, list[str]]:
    from teachers import TEACHER_BACKENDS

    registries = {**algorithm_registries(), **BACKEND_REGISTRIES, TEACHER_BACKENDS.kind: TEACHER_BACKENDS}
    return {kind: registries[kind].names() for kind in CHOICE_KEYS}


def test_every_registered_choice_is_run_or_refused():
    covered = {(kind, name) for _, _, covers in RUNS + [(i, o, c) for i, o, _, c in VLLM_RUNS]
               for kind, name in covers.items()}
    refused = {about for about, _, _, _ in REFUSED + REFUSED_WITHOUT_VLLM if about is not None}
    missing = [(kind, name) for kind, names in _registered().items() for name in names
               if (kind, name) not in covered | refused]
    assert missing == []


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir):
    return loop_models(tmp_path_factory.mktemp("choices"), tiny_model_dir, RECIPE)


def _spec_with_backend(models: Path, backend: str) -> Path:
    """A copy of the tiny teacher's spec on another backend (a server URL that is never contacted)."""
    path = models / f"teacher-{backend}.yaml"
    text = (models / "teacher.yaml").read_text().replace("backend: transformers", f"backend: {backend}")
    if backend == "vllm_server":
        text += "url: http://127.0.0.1:9\n"
    path.write_text(text)
    return path


@pytest.mark.parametrize("about, overrides, backend, message", REFUSED + (REFUSED_WITHOUT_VLLM if not HAS_VLLM else []))
def test_refused_before_any_heavy_work(models, about, overrides, backend, message, no_network):
    extra = [f"teachers.alfworld={_spec_with_backend(models, backend)}"] if backend else []
    with pytest.raises(RecipeError) as err:
        check_setup(load_recipe(models / "recipe.yaml", [*overrides, *extra]))
    spec = str(models / f"teacher-{backend}.yaml") if backend else ""
    assert message.format(spec=spec) in str(err.value)


def _distill(models: Path, name: str, overrides: list[str]) -> list[dict]:
    env = child_env()
    run = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(models / "recipe.yaml"), f"name={name}",
                          *overrides], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return read_metrics(models / "runs" / name / "metrics.jsonl")


def _check_two_steps(records: list[dict], overrides: list[str]) -> None:
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["loss"]) and not r["skipped"] and r["tokens_trained"] > 0 for r in train)
    assert [r["kind"] for r in records if r["kind"] == "eval"] == ["eval"]  # the final evaluation
    given = dict(o.split("=", 1) for o in overrides)
    assert all(r["pipeline"]["mode"] == given.get("pipeline.mode", "sync") for r in train)
    depth = given.get("depth.mode", "adaptive")
    caps = [r["rollout_depth_cap"] for r in train]
    # a probe step plays a step's batch (trainer.episodes_per_step = 2), no more
    assert [r["episodes"] for r in train] == [2, 2]
    if "depth.probe_fraction" in given:  # round(0.5 x 2) = 1 probe every step, the controller updated by each
        assert [r["probes"] for r in train] == [1, 1] and [r["probed"] for r in train] == [False, False]
        assert all(r["h_eff"] is not None for r in train) and caps[0] == 3  # h_max through the warm-up step
    else:
        assert caps == {"adaptive": [3, 3], "fixed": [2, 2], "curriculum": [1, 2], "full": [3, 3]}[depth]
        assert [r["probed"] for r in train] == ([False, True] if depth == "adaptive" else [False, False])
        assert [r["probes"] for r in train] == ([0, 2] if depth == "adaptive" else [0, 0])
    loss_mode = given.get("loss.mode", "progressive")
    alphas = [r["alpha"] for r in train]
    if loss_mode == "progressive":
        schedule = given.get("loss.alpha_schedule", "linear")
        # k/K = 1/2, 2/2: linear .5, 1; cosine (1 - cos(pi/2))/2 = .5, 1; step 1, 1; constant .3
        assert alphas == pytest.approx({"linear": [0.5, 1.0], "cosine": [0.5, 1.0], "step": [1.0, 1.0],
                                        "constant": [0.3, 0.3]}[schedule])
    else:
        assert alphas == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides, covers", RUNS, ids=[r[0] for r in RUNS])
def test_choice_runs_two_real_steps(models, name, overrides, covers):
    _check_two_steps(_distill(models, name, overrides), overrides)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed in this environment (run in the vLLM venv)")
@pytest.mark.parametrize("name, overrides, backend, covers", VLLM_RUNS, ids=[r[0] for r in VLLM_RUNS])
def test_vllm_choices_run(models, name, overrides, backend, covers, request):
    extra = []
    if backend == "vllm_server":
        spec_path, _, _ = request.getfixturevalue("teacher_server")
        extra = [f"teachers.alfworld={spec_path}"]
    elif backend != "transformers":
        extra = [f"teachers.alfworld={_spec_with_backend(models, backend)}"]
    _check_two_steps(_distill(models, name, [*overrides, *extra]), overrides)


@pytest.fixture(scope="module")
def teacher_server(tiny_model_dir, tmp_path_factory):
    from tests.teachers.test_vllm_teachers import serve_teacher

    with serve_teacher(tiny_model_dir, tmp_path_factory) as served:
        yield served


def test_topk_scores_reach_the_trainer(models):
    """topk: the rollout source scores with objective.topk, so the batch carries the teacher's top-k."""
    from turnopd.orchestration.pipeline import scoring_topk

    assert scoring_topk(load_recipe(models / "recipe.yaml", ["objective.estimator=topk", "objective.topk=7"])) == 7
    assert scoring_topk(load_recipe(models / "recipe.yaml")) == 0
