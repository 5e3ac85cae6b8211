"""prompt.style=chat on the real vLLM (vllm-cpu; run in the vLLM venv: `pytest -m vllm
tests/rollout/test_vllm_chat.py`): a tiny random model with SmolLM2-135M-Instruct's real tokenizer
and template plays real ALFWorld games through the real env pool; every prompt appends the ids vLLM
sampled, each trajectory is one sequence, and one transformers forward pass over it gives the
log-probs vLLM sampled its tokens with (fp32): the trained and scored ids are the sampled ones."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm is not installed in this environment (run in the vLLM venv)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

from turnopd.config import EnvConfig, PolicyConfig, PromptConfig  # noqa: E402
from turnopd.core.types import build_token_batch, trajectory_sequences  # noqa: E402
from turnopd.rollout import POLICY_BACKENDS, SamplingParams  # noqa: E402

IM_END = 2  # SmolLM2's <|im_end|>, its EOS


@pytest.fixture(scope="module")
def played(smollm2_tiny_model_dir):
    from envs import make_env_spec
    from envs.pool import EnvPool
    from turnopd.rollout.agent_loop import rollout

    policy = POLICY_BACKENDS.get("vllm")(smollm2_tiny_model_dir, PolicyConfig(options={"max_model_len": 4096}),
                                         dtype="float32")
    env_config = EnvConfig(name="alfworld", max_turns=4, template="compact", answer_format="action")
    spec = make_env_spec(env_config)
    try:
        with EnvPool(spec, num_workers=1, step_timeout_s=120) as pool:
            return rollout(spec, pool, policy, spec.tasks("valid_seen")[:2], env_config=env_config,
                           sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=5),
                           prompt=PromptConfig(style="chat"))
    finally:
        policy.close()


def test_each_prompt_appends_the_ids_vllm_sampled(played):
    for trajectory in played:
        assert trajectory.depth == 4
        for before, after in itertools.pairwise(trajectory.turns):
            m = len(before.prompt_ids) + len(before.action_ids)
            assert after.prompt_ids[:m] == before.prompt_ids + before.action_ids
            assert after.prompt_ids[m - 1 if before.action_ids[-1] == IM_END else m] == IM_END


def test_one_pass_over_the_sequence_gives_the_sampled_logprobs(played, smollm2_tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_tiny_model_dir, dtype=torch.float32).eval()
    for trajectory in played:
        (sequence,) = trajectory_sequences(trajectory, "teacher")
        with torch.no_grad():
            logprobs = model(torch.tensor([sequence.ids])).logits[0].log_softmax(-1)
        for (start, end, _), turn in zip(sequence.spans, trajectory.turns, strict=True):
            assert sequence.ids[start:end] == turn.action_ids
            scored = [logprobs[p - 1, sequence.ids[p]].item() for p in range(start, end)]
            assert scored == pytest.approx(turn.student_logprobs, abs=1e-4)
    batch = build_token_batch(played)
    assert batch.input_ids[batch.loss_mask].tolist() == [t for traj in played for turn in traj.turns
                                                         for t in turn.action_ids]
