"""The vllm policy backend on the real vLLM (vllm-cpu here; run in the vLLM venv:
`pytest -m vllm tests/rollout/test_vllm_policy.py`): its tokens and log-probs against transformers
forward passes of the same tiny model in fp32, seeded samples under continuous batching, and
in-place weight reload for an untied and a tied model."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vllm is not installed in this environment (run in the vLLM venv)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

from turnopd.config import EnvConfig, PolicyConfig  # noqa: E402
from turnopd.models.tiny import build_tiny_model  # noqa: E402
from turnopd.rollout import POLICY_BACKENDS, SamplingParams  # noqa: E402
from turnopd.rollout.base import generate_all  # noqa: E402
from turnopd.rollout.render import chat_prompt_ids  # noqa: E402

MESSAGES = ["You arrive at desk 1.", "Your task is to: put some pencil on desk. You see a bed 1.", "Nothing happens."]
OPTIONS = {"max_model_len": 1024}


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        lp = model(torch.tensor([prompt + completion])).logits[0].float().log_softmax(-1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


def greedy_reference(model, prompt: list[int], steps: int, eos: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == eos:
                break
    return ids[len(prompt):]


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.fixture(scope="module")
def untied(tiny_model_dir):
    policy = POLICY_BACKENDS.get("vllm")(tiny_model_dir, PolicyConfig(max_batch_size=16, options=OPTIONS),
                                         dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    yield policy, model
    policy.close()


@pytest.fixture(scope="module")
def tied(tiny_model_dir, tmp_path_factory):
    """A tied-embeddings model handed over as a loaded module (as the trainer's student is)."""
    path = build_tiny_model(tmp_path_factory.mktemp("tied") / "m", tokenizer=tiny_model_dir, hidden_size=64,
                            num_heads=2, tie_word_embeddings=True, max_position_embeddings=1024, seed=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    from transformers import AutoTokenizer

    policy = POLICY_BACKENDS.get("vllm")(model, PolicyConfig(options=OPTIONS), tokenizer=AutoTokenizer.from_pretrained(path),
                                         dtype="float32")
    yield policy, model
    policy.close()


def prompts_for(policy) -> list[list[int]]:
    return [chat_prompt_ids(policy.tokenizer, m) for m in MESSAGES]


def check_greedy_matches(policy, model, steps: int = 10) -> None:
    out = generate_all(policy, prompts_for(policy), SamplingParams(temperature=0.0, max_new_tokens=steps, stop=()))
    for prompt, gen in zip(prompts_for(policy), out, strict=True):
        assert gen.token_ids == greedy_reference(model, prompt, steps, policy.tokenizer.eos_token_id)
        assert gen.logprobs == pytest.approx(forward_logprobs(model, prompt, gen.token_ids), abs=1e-4)


def test_greedy_tokens_and_logprobs_match_transformers(untied):
    check_greedy_matches(*untied)


def test_seeded_samples_and_raw_logprobs(untied):
    policy, model = untied
    prompts = prompts_for(policy) * 4  # each prompt 4 times: 4 requests with seeds of their own
    sampling = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=8, stop=(), seed=21)
    out = generate_all(policy, prompts, sampling)
    for prompt, gen in zip(prompts, out, strict=True):
        assert 1 <= len(gen.token_ids) == len(gen.logprobs) <= 8
        # raw log-probs (temperature 1, no top-p), as the transformers backend stores
        assert gen.logprobs == pytest.approx(forward_logprobs(model, prompt, gen.token_ids), abs=1e-4)
    assert len({tuple(out[i].token_ids) for i in (0, 3, 6, 9)}) == 4  # one prompt, 4 seeds, 4 samples
    # the seeds reproduce the samples, also when the requests are batched otherwise (one at a time)
    assert [g.token_ids for g in generate_all(policy, prompts, sampling)] == [g.token_ids for g in out]
    alone = [generate_all(policy, [prompt], sampling)[0] for prompt in prompts[:1]]
    assert alone[0].token_ids == out[0].token_ids


def test_seeded_batch_larger_than_one_prefill_chunk(untied):
    """8 seeded prompts of 600 tokens exceed vLLM's 4096-token prefill budget (vllm-cpu 0.32 crashed
    on this with chunked prefill on: 'CPU Generator does not use offset')."""
    policy, model = untied
    prompts = [[5 + (i + j) % 90 for j in range(600)] for i in range(8)]
    out = generate_all(policy, prompts, SamplingParams(temperature=1.0, max_new_tokens=4, stop=(), seed=5))
    for prompt, gen in zip(prompts, out, strict=True):
        assert gen.logprobs == pytest.approx(forward_logprobs(model, prompt, gen.token_ids), abs=1e-4)


def test_stop_strings_cut_like_transformers(untied, tiny_model_dir):
    policy, model = untied
    hf = POLICY_BACKENDS.get("transformers")(model, PolicyConfig(), tokenizer=policy.tokenizer)
    free = generate_all(policy, prompts_for(policy)[:1], SamplingParams(temperature=0.0, max_new_tokens=16, stop=()))[0]
    stop = (free.text[4:7],)
    a = generate_all(policy, prompts_for(policy), SamplingParams(temperature=0.0, max_new_tokens=16, stop=stop))
    b = generate_all(hf, prompts_for(policy), SamplingParams(temperature=0.0, max_new_tokens=16, stop=stop))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.text for g in a] == [g.text for g in b]
    assert a[0].finish_reason == "stop" and stop[0] in a[0].text
    assert len(a[0].token_ids) < len(free.token_ids)


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_weight_reload_matches_new_weights(which, request):
    policy, model = request.getfixturevalue(which)
    check_greedy_matches(policy, model)
    version = policy.weight_version
    perturb(model, seed=7)
    policy.update_weights(model)
    assert policy.weight_version == version + 1
    check_greedy_matches(policy, model)
    # a state dict works the same way (and a second reload in a row)
    perturb(model, seed=8)
    policy.update_weights(model.state_dict())
    check_greedy_matches(policy, model)


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_weight_reload_from_a_checkpoint_folder(which, request, tmp_path):
    policy, model = request.getfixturevalue(which)
    perturb(model, seed=9)
    model.save_pretrained(tmp_path / "ckpt")
    policy.update_weights(tmp_path / "ckpt")
    check_greedy_matches(policy, model)


def test_alfworld_rollout_with_vllm_policy(untied):
    """Real ALFWorld games through the real env pool: every turn holds the tokens vLLM sampled and
    their log-probs as transformers computes them for exactly the recorded prompt."""
    from envs import make_env_spec
    from envs.pool import EnvPool
    from turnopd.rollout.agent_loop import rollout

    policy, model = untied
    env_config = EnvConfig(name="alfworld", max_turns=4, history_length=0)
    spec = make_env_spec(env_config)
    tasks = spec.tasks("valid_seen")[:2]
    with EnvPool(spec, num_workers=1, step_timeout_s=120) as pool:
        trajs = rollout(spec, pool, policy, tasks, env_config=env_config, turn_limits=[2, 2],
                        sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=2))
    assert [t.depth for t in trajs] == [2, 2] and all(t.truncated for t in trajs)
    assert all(t.weight_version == policy.weight_version for t in trajs)
    for traj in trajs:
        for turn in traj.turns:
            assert turn.student_logprobs == pytest.approx(
                forward_logprobs(model, turn.prompt_ids, turn.action_ids), abs=1e-4)
            if not spec.parse_action(turn.action_text).valid:
                assert turn.invalid


def test_module_without_tokenizer_is_refused(untied):
    with pytest.raises(ValueError, match="needs the tokenizer"):
        POLICY_BACKENDS.get("vllm")(untied[1], PolicyConfig())


def perturb_adapter(model, seed: int) -> None:
    """New LoRA B matrices (a fresh adapter's are zero, which would leave the base's outputs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def test_lora_student_syncs_its_adapter_only(tiny_model_dir):
    """A LoRA student (a peft model, tied head) served as vLLM's LoRA adapter: its greedy tokens and
    log-probs are the peft model's, before and after adapter syncs (from the module and from the
    adapter tensors the generator process gets), and differ from the base model's."""
    from transformers import AutoTokenizer

    from turnopd.config import LoraConfig
    from turnopd.loaders.lora import add_adapter, sync_state

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = add_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                        LoraConfig(rank=4, alpha=8.0)).eval()
    perturb_adapter(model, seed=1)
    policy = POLICY_BACKENDS.get("vllm")(model, PolicyConfig(options=OPTIONS),
                                         tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir), dtype="float32")
    try:
        check_greedy_matches(policy, model)
        prompt = prompts_for(policy)[1]
        (gen,) = generate_all(policy, [prompt], SamplingParams(temperature=0.0, max_new_tokens=8, stop=()))
        assert max(abs(a - b) for a, b in zip(gen.logprobs, forward_logprobs(base, prompt, gen.token_ids),
                                              strict=True)) > 1e-2  # the adapter is what it samples with
        perturb_adapter(model, seed=2)
        policy.update_weights(model)
        check_greedy_matches(policy, model)
        perturb_adapter(model, seed=3)
        policy.update_weights(sync_state(model))
        check_greedy_matches(policy, model)
        with pytest.raises(TypeError, match="takes the adapter"):
            policy.update_weights(tiny_model_dir)
    finally:
        policy.close()
