"""Teachers without vLLM: the transformers backend against plain forward passes, trajectory
scoring (one pass vs per turn), routing, specs, the tokenizer guard and the server client's
retry-then-error on a port where nothing listens. vLLM backends: tests/teachers/test_vllm_teachers.py."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch

from teachers import (
    TEACHER_BACKENDS,
    TeacherServerError,
    TeacherSpec,
    TeacherSpecError,
    TokenizerMismatchError,
    check_tokenizers,
    load_teacher_spec,
    make_teacher,
    make_teachers,
    save_teacher_spec,
    score_trajectories,
    server_command,
)
from teachers.base import Teacher
from turnopd.core.types import Trajectory, Turn, trajectory_sequences
from turnopd.models.tiny import build_tiny_model, build_tokenizer


@pytest.fixture(scope="module")
def teacher(tiny_model_dir):
    return make_teacher(TeacherSpec(name="tiny-teacher", model=str(tiny_model_dir), dtype="float32",
                                    max_length=1024, options={"max_batch_tokens": 64}))


def forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab] log-probs predicting ids[1:], from one unpadded forward pass."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_scores_equal_unpadded_forward(teacher):
    vocab = len(teacher.tokenizer)
    sequences = [random_ids(n, vocab, seed) for seed, n in enumerate((30, 5, 17, 2, 40))]
    scores = teacher.score(sequences, topk=4)  # a 64-token budget: several padded batches
    for ids, s in zip(sequences, scores, strict=True):
        lp = forward_logprobs(teacher.model, ids)
        assert s.logprobs[0] == 0.0 and s.topk_ids[0] == [] and s.topk_logprobs[0] == []
        expected = lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
        assert s.logprobs[1:] == pytest.approx(expected, abs=1e-5)
        top = lp.topk(4, dim=-1)
        assert s.topk_ids[1:] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(s.topk_logprobs[1:]), top.values, atol=1e-5, rtol=0)
    assert all(s.topk_ids is None for s in teacher.score(sequences[:2]))


def test_bad_sequences_fail_before_scoring(teacher):
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        teacher.score([[1, 2], []])
    with pytest.raises(ValueError, match="sequence 0 has 1025 tokens > its max_length 1024"):
        teacher.score([[3] * 1025])


def appending_trajectory(vocab: int, turns: int, seed: int, env: str = "alfworld") -> Trajectory:
    """A multi-turn chat that only appends: each prompt = previous prompt + answer + new observation."""
    context: list[int] = []
    out = []
    for t in range(turns):
        context = context + random_ids(6 + t, vocab, seed * 100 + t)
        action = random_ids(3 + t % 2, vocab, seed * 100 + 50 + t)
        out.append(Turn(t, f"obs {t}", list(context), action, [-1.0] * len(action)))
        context = context + action
    return Trajectory(task_id=f"task-{seed}", env_name=env, turns=out)


def windowed_trajectory(vocab: int, turns: int, seed: int, env: str = "alfworld") -> Trajectory:
    """Prompts re-rendered every turn (what the rollout engine produces)."""
    out = []
    for t in range(turns):
        prompt = random_ids(8 + t, vocab, seed * 100 + t)
        action = random_ids(4, vocab, seed * 100 + 50 + t)
        out.append(Turn(t, f"obs {t}", prompt, action, [-1.0] * len(action)))
    return Trajectory(task_id=f"task-{seed}", env_name=env, turns=out)


class CountingTeacher(Teacher):
    """Wraps a real teacher to count what it is asked to score."""

    def __init__(self, inner):
        self.inner, self.name, self.max_length = inner, inner.name, inner.max_length
        self.calls: list[int] = []

    def score(self, sequences, topk=0):
        self.calls.append(len(sequences))
        return self.inner.score(sequences, topk)


def test_one_pass_equals_per_turn_scoring(teacher):
    vocab = len(teacher.tokenizer)
    trajs = [appending_trajectory(vocab, 4, seed=1), appending_trajectory(vocab, 3, seed=2)]
    counting = CountingTeacher(teacher)
    scored = score_trajectories({"alfworld": counting}, trajs, topk=3)
    assert counting.calls == [2]  # one call, one sequence per trajectory
    assert scored == sum(len(t.turns[-1].prompt_ids) + len(t.turns[-1].action_ids) for t in trajs)
    for traj in trajs:
        for turn in traj.turns:
            # the same turn scored alone, on its own prompt + action
            lp = forward_logprobs(teacher.model, turn.prompt_ids + turn.action_ids)[len(turn.prompt_ids) - 1 :]
            expected = lp.gather(1, torch.tensor(turn.action_ids)[:, None]).squeeze(1).tolist()
            assert turn.teacher_logprobs == pytest.approx(expected, abs=1e-5)
            assert turn.teacher_topk_ids == lp.topk(3, dim=-1).indices.tolist()
            assert len(turn.teacher_topk_logprobs) == len(turn.action_ids)


def test_windowed_trajectories_score_each_turn_window(teacher):
    vocab = len(teacher.tokenizer)
    trajs = [windowed_trajectory(vocab, 3, seed=3), windowed_trajectory(vocab, 2, seed=4)]
    assert [len(trajectory_sequences(t)) for t in trajs] == [3, 2]
    counting = CountingTeacher(teacher)
    score_trajectories({"alfworld": counting}, trajs)
    assert counting.calls == [5]  # every window of every trajectory in one batched call
    for traj in trajs:
        for turn in traj.turns:
            lp = forward_logprobs(teacher.model, turn.prompt_ids + turn.action_ids)[len(turn.prompt_ids) - 1 :]
            assert turn.teacher_logprobs == pytest.approx(
                lp.gather(1, torch.tensor(turn.action_ids)[:, None]).squeeze(1).tolist(), abs=1e-5)
            assert turn.teacher_topk_ids is None


def test_routing_by_env_and_missing_teacher(teacher, tiny_model_dir, tmp_path):
    other_dir = build_tiny_model(tmp_path / "other", tokenizer=tiny_model_dir, hidden_size=64, num_heads=2, seed=9)
    other = make_teacher(TeacherSpec(name="other", model=str(other_dir), dtype="float32", max_length=256))
    vocab = len(teacher.tokenizer)
    a, b = windowed_trajectory(vocab, 2, seed=5, env="alfworld"), windowed_trajectory(vocab, 2, seed=5, env="webshop")
    score_trajectories({"alfworld": teacher, "webshop": other}, [a, b])
    for traj, model in ((a, teacher.model), (b, other.model)):
        turn = traj.turns[1]
        lp = forward_logprobs(model, turn.prompt_ids + turn.action_ids)[len(turn.prompt_ids) - 1 :]
        assert turn.teacher_logprobs == pytest.approx(
            lp.gather(1, torch.tensor(turn.action_ids)[:, None]).squeeze(1).tolist(), abs=1e-5)
    assert a.turns[1].teacher_logprobs != pytest.approx(b.turns[1].teacher_logprobs, abs=1e-3)
    c = windowed_trajectory(vocab, 2, seed=6, env="search")
    with pytest.raises(KeyError, match="no teacher for env.* search"):
        score_trajectories({"alfworld": teacher}, [a, c])
    long = Trajectory("long", "alfworld", [Turn(0, "", [5] * 1020, [6] * 10, [0.0] * 10)])
    with pytest.raises(ValueError, match="task long .* 1030 tokens > teacher tiny-teacher's max_length 1024"):
        score_trajectories({"alfworld": teacher}, [long])


def test_spec_files(tmp_path, tiny_model_dir):
    folder = tmp_path / "teachers" / "alfworld"
    folder.mkdir(parents=True)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "t").symlink_to(tiny_model_dir)
    (folder / "teacher.yaml").write_text("name: alf\nmodel: ../../models/t\ndtype: float32\nmax_length: 512\n")
    spec = load_teacher_spec(folder / "teacher.yaml")
    assert spec.model == str((tmp_path / "models" / "t").resolve())
    assert (spec.backend, spec.max_length, spec.source) == ("transformers", 512, str(folder / "teacher.yaml"))
    # round trip
    saved = save_teacher_spec(spec, tmp_path / "copy" / "teacher.yaml", comment="Written by a test.\n\nSecond line.")
    assert saved.read_text().startswith("# Written by a test.\n#\n# Second line.\nname: alf\n")
    again = load_teacher_spec(saved)
    assert (again.name, again.model, again.dtype, again.max_length) == (spec.name, spec.model, "float32", 512)
    # two envs naming one spec file share one loaded teacher
    teachers = make_teachers({"alfworld": spec, "webshop": spec})
    assert teachers["alfworld"] is teachers["webshop"]
    bad = {
        "model: x\n": "missing a value: name",
        "name: a\nmodel: x\nbackend: nope\n": "'backend': 'nope' is not allowed; allowed: transformers, vllm, vllm_server",
        "name: a\nmodel: x\nmax_len: 3\n": "max_len",
        "name: a\nmodel: x\nbackend: vllm_server\n": "needs `url`",
        "name: a\nmodel: x\nbackend: vllm_server\nurl: http://h:1\nurls: [http://h:2]\n": "`url` or `urls`, not both",
        "name: a\nmodel: x\nbackend: vllm\noptions: {max_model_len: 9}\n": "'options.max_model_len'",
    }
    for text, message in bad.items():
        (folder / "bad.yaml").write_text(text)
        with pytest.raises(TeacherSpecError, match=message.replace("(", r"\(")) as err:
            load_teacher_spec(folder / "bad.yaml")
        assert "bad.yaml" in str(err.value)
    with pytest.raises(TeacherSpecError, match="not found"):
        load_teacher_spec(tmp_path / "missing.yaml")
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        make_teacher(TeacherSpec(name="gone", model=str(tmp_path / "gone")))


def test_spec_with_sft_recipe_builds_its_missing_model_once(tmp_path, tiny_model_dir, monkeypatch):
    """A spec with `sft_recipe` names a local folder (even while missing) and trains it there with
    that recipe when it is missing, through the `sft` model preparation (its real run is the
    quickstart's slow test)."""
    import turnopd.models as models
    from turnopd.orchestration.sft import build_missing_teacher

    folder = tmp_path / "teachers" / "alfworld"
    folder.mkdir(parents=True)
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "teacher_sft.yaml").write_text("name: t\n")
    (folder / "teacher.yaml").write_text("name: alf\nmodel: ../../runs/alf\nsft_recipe: ../../recipes/teacher_sft.yaml\n")
    spec = load_teacher_spec(folder / "teacher.yaml")
    assert spec.model == str(tmp_path / "runs" / "alf")  # not a hub name, although missing
    assert spec.sft_recipe == str(tmp_path / "recipes" / "teacher_sft.yaml")
    calls = []

    def fake_sft(out_dir, recipe, overrides=()):
        calls.append((str(out_dir), recipe))
        Path(out_dir).mkdir(parents=True)
        return Path(out_dir)

    monkeypatch.setitem(models.MODEL_PREPARERS._entries, "sft", fake_sft)
    build_missing_teacher(spec)
    build_missing_teacher(spec)  # there now: not built again
    assert calls == [(spec.model, spec.sft_recipe)]
    # the spec `turnopd sft` writes records the recipe, relative when under the repository
    saved = save_teacher_spec(spec, tmp_path / "copy.yaml")
    assert "sft_recipe: " + str(tmp_path / "recipes" / "teacher_sft.yaml") in saved.read_text()
    (folder / "bad.yaml").write_text("name: a\nmodel: x\nsft_recipe: nowhere.yaml\n")
    with pytest.raises(TeacherSpecError, match="'sft_recipe': .*nowhere.yaml not found"):
        load_teacher_spec(folder / "bad.yaml")


def test_server_command_for_a_spec():
    spec = TeacherSpec(name="alf", model="/m", dtype="float32", max_length=777,
                       options={"max_logprobs": 5, "server_args": ["--seed", 3]})
    cmd = server_command(spec, port=8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model"] == "/m" and flags["--served-model-name"] == "alf" and flags["--port"] == "8123"
    assert flags["--max-model-len"] == "777" and flags["--max-logprobs"] == "5" and flags["--dtype"] == "float32"
    assert cmd[-2:] == ["--seed", "3"]


def test_tokenizer_guard(tiny_model_dir, teacher, tmp_path):
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_tokenizers(student, teacher.tokenizer, "student-dir", "tiny-teacher")
    other = build_tokenizer(["a completely different corpus of words, spelled differently"] * 3)
    with pytest.raises(TokenizerMismatchError, match=r"student tokenizer \(student-dir\) and teacher tokenizer "
                                                     r"\(other-teacher\) differ: vocabulary sizes"):
        check_tokenizers(student, other, "student-dir", "other-teacher")
    # same size, different ids: the same tokenizer with two ids swapped
    swapped_dir = tmp_path / "swapped"
    student.save_pretrained(swapped_dir)
    swapped = AutoTokenizer.from_pretrained(swapped_dir)
    probe_ids = student("go to countertop 1", add_special_tokens=False)["input_ids"]
    vocab = swapped.backend_tokenizer.to_str()
    import json

    data = json.loads(vocab)
    inv = {v: k for k, v in data["model"]["vocab"].items()}
    a, b = probe_ids[0], probe_ids[-1]
    data["model"]["vocab"][inv[a]], data["model"]["vocab"][inv[b]] = b, a
    (swapped_dir / "tokenizer.json").write_text(json.dumps(data))
    swapped = AutoTokenizer.from_pretrained(swapped_dir)
    assert len(swapped) == len(student)
    with pytest.raises(TokenizerMismatchError, match="ids for the probe text"):
        check_tokenizers(student, swapped, "student-dir", "swapped")
    # same tokens, another chat template
    templated = AutoTokenizer.from_pretrained(tiny_model_dir)
    templated.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(TokenizerMismatchError, match="chat templates"):
        check_tokenizers(student, templated, "student-dir", "templated")


def test_server_client_retries_then_fails_clearly(tiny_model_dir):
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = make_teacher(TeacherSpec(name="t", model=str(tiny_model_dir), backend="vllm_server",
                                      url=f"http://127.0.0.1:{port}", max_length=64,
                                      options={"timeout_s": 1.5, "backoff_s": 0.1}))
    assert client.tokenizer is not None  # the local tokenizer, for the start-up guard
    t0 = time.monotonic()
    with pytest.raises(TeacherServerError, match=r"no answer within 1.5 s \((\d+) attempts\).*ConnectionError") as err:
        client.score([[1, 2, 3]])
    elapsed = time.monotonic() - t0
    attempts = int(err.value.args[0].split("(")[1].split()[0])
    assert attempts >= 3  # 0.1 + 0.2 + 0.4 + 0.8 s of backoff fit in 1.5 s
    assert 0.6 <= elapsed <= 5.0


def lora_spec(model, adapter, **kw) -> TeacherSpec:
    return TeacherSpec(name="tiny-lora", model=str(model), adapter=str(adapter), dtype="float32", max_length=1024,
                       options={"max_batch_tokens": 64}, **kw)


def test_lora_teacher_scores_like_its_unmerged_peft_model(lora_adapter, tiny_model_dir, teacher):
    adapter_dir, peft_model = lora_adapter
    lora = make_teacher(lora_spec(tiny_model_dir, adapter_dir))
    assert type(lora.model).__name__ == "LlamaForCausalLM"  # merged: a plain model, no peft layers
    assert not any("lora_" in name for name, _ in lora.model.named_parameters())
    vocab = len(lora.tokenizer)
    sequences = [random_ids(n, vocab, seed) for seed, n in enumerate((30, 5, 17, 2, 40))]
    scores, base_scores = lora.score(sequences, topk=4), teacher.score(sequences)
    largest_change = 0.0
    for ids, s, b in zip(sequences, scores, base_scores, strict=True):
        lp = forward_logprobs(peft_model, ids)  # the adapter un-merged: base + B A x at every projection
        expected = lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(s.logprobs[1:]), expected, atol=1e-5, rtol=0)
        top = lp.topk(4, dim=-1)
        assert s.topk_ids[1:] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(s.topk_logprobs[1:]), top.values, atol=1e-5, rtol=0)
        largest_change = max(largest_change, (torch.tensor(s.logprobs) - torch.tensor(b.logprobs)).abs().max().item())
    assert largest_change > 0.1  # the adapter changes the teacher: this test could fail
    # the tokenizer is the base's: the guard passes against the student's tokenizer as before
    from transformers import AutoTokenizer

    check_tokenizers(AutoTokenizer.from_pretrained(tiny_model_dir), lora.tokenizer, "student", "tiny-lora")


def test_adapter_specs_checked_at_load(lora_adapter, tiny_model_dir, tmp_path):
    import json
    import shutil
    import warnings

    from teachers.spec import AdapterBaseWarning, served_model_name
    from teachers.vllm_server import VLLMServerTeacher

    adapter_dir, _ = lora_adapter
    folder = tmp_path / "teachers" / "alfworld"
    folder.mkdir(parents=True)
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "a").symlink_to(adapter_dir)
    (folder / "teacher.yaml").write_text(f"name: alf\nmodel: {tiny_model_dir}\nadapter: ../../adapters/a\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own base: no warning
        spec = load_teacher_spec(folder / "teacher.yaml")
    assert spec.adapter == str((tmp_path / "adapters" / "a").resolve())  # resolved like `model`
    saved = save_teacher_spec(spec, tmp_path / "copy" / "teacher.yaml")
    assert load_teacher_spec(saved).adapter == spec.adapter

    def variant(name: str, **changes) -> str:
        """A copy of the adapter with its adapter_config.json changed."""
        path = tmp_path / name
        shutil.copytree(adapter_dir, path)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
        return str(path)

    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    bad = {
        f"adapter: {tmp_path / 'nowhere'}\n": r"key 'adapter': .*nowhere not found \(a PEFT LoRA adapter folder",
        f"adapter: {tmp_path / 'empty'}\n": r"key 'adapter': .*empty has no adapter_config.json",
        f"adapter: {tmp_path / 'broken'}\n": r"key 'adapter': .*adapter_config.json is not valid JSON",
        f"adapter: {variant('prefix', peft_type='PREFIX_TUNING')}\n":
            r"key 'adapter': .*prefix is a 'PREFIX_TUNING' adapter; a teacher adapter must be LoRA",
        "adapter_name: x\n": r"key 'adapter_name': names the served LoRA module",
        f"adapter: {adapter_dir}\nadapter_name: a\n": r"key 'adapter_name': 'a' is also the served name of the base",
    }
    for text, message in bad.items():
        (folder / "bad.yaml").write_text(f"name: a\nmodel: {tiny_model_dir}\n" + text)
        with pytest.raises(TeacherSpecError, match=message) as err:
            load_teacher_spec(folder / "bad.yaml")
        assert "bad.yaml" in str(err.value)
    # a spec built in code is checked when its teacher is made, before any model loads
    with pytest.raises(TeacherSpecError, match=r"teacher spec gone: key 'adapter': .*nowhere not found"):
        make_teacher(TeacherSpec(name="gone", model=str(tiny_model_dir), adapter=str(tmp_path / "nowhere")))
    # trained on another base: a warning naming both (the base names often differ for the same weights)
    (folder / "other.yaml").write_text(f"name: a\nmodel: {tiny_model_dir}\n"
                                       f"adapter: {variant('other', base_model_name_or_path='Org/other-model')}\n")
    with pytest.warns(AdapterBaseWarning, match=r"trained on 'Org/other-model' \(base_model_name_or_path\), not on"):
        load_teacher_spec(folder / "other.yaml")

    # vLLM: the smallest allowed max_lora_rank that holds the adapter's rank (rank_pattern included)
    spec.options = {"max_logprobs": 5}
    cmd = server_command(spec, port=8123)
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--served-model-name"] == "alf" and flags["--model"] == str(tiny_model_dir)
    i = cmd.index("--enable-lora")
    assert cmd[i + 1 : i + 7] == ["--lora-modules", f"alf-lora={spec.adapter}", "--max-lora-rank", "8",
                                  "--max-loras", "1"]
    spec.adapter = variant("wide", r=8, rank_pattern={"q_proj": 20})
    assert server_command(spec)[server_command(spec).index("--max-lora-rank") + 1] == "32"
    # requests name the adapter's module: adapter_name, default <name>-lora; the base keeps its name
    spec.backend, spec.url = "vllm_server", "http://127.0.0.1:9"
    assert VLLMServerTeacher(spec).model_name == served_model_name(spec) == "alf-lora"
    spec.adapter_name = "alf-sft"
    assert VLLMServerTeacher(spec).model_name == "alf-sft"
    assert served_model_name(spec, base=True) == "alf"
    # a server started elsewhere: adapter_name alone names its LoRA module; no adapter to serve here
    spec.adapter = None
    assert VLLMServerTeacher(spec).model_name == "alf-sft"
    with pytest.raises(TeacherSpecError, match="key 'adapter_name': 'alf-sft' names a LoRA module, but the spec has no"):
        server_command(spec)


KEY_VARIABLE = "TURNOPD_TEST_TEACHER_KEY"


def test_api_key_env_names_a_set_variable_and_never_holds_the_key(tmp_path, monkeypatch):
    from teachers.spec import api_key

    server = "name: t\nmodel: m\nbackend: vllm_server\nurl: http://127.0.0.1:9\n"
    (tmp_path / "keyed.yaml").write_text(server + f"api_key_env: {KEY_VARIABLE}\n")
    monkeypatch.setenv(KEY_VARIABLE, "s3cret")
    spec = load_teacher_spec(tmp_path / "keyed.yaml")
    assert (spec.api_key_env, api_key(spec)) == (KEY_VARIABLE, "s3cret")
    saved = save_teacher_spec(spec, tmp_path / "copy.yaml").read_text()
    assert f"api_key_env: {KEY_VARIABLE}" in saved and "s3cret" not in saved  # the name travels, not the key
    assert api_key(TeacherSpec(name="t", model="m", backend="vllm_server", url="http://h:1")) is None
    for unset in ("", None):  # an empty variable is as good as none
        if unset is None:
            monkeypatch.delenv(KEY_VARIABLE)
        else:
            monkeypatch.setenv(KEY_VARIABLE, unset)
        with pytest.raises(TeacherSpecError, match=f"keyed.yaml: key 'api_key_env': the environment variable "
                                                   f"{KEY_VARIABLE} is not set"):
            load_teacher_spec(tmp_path / "keyed.yaml")
    bad = {
        "api_key: s3cret-in-the-file\n": "key 'api_key': the API key does not go in the spec",
        "api_key_env: sk-live-s3cret-in-the-file\n": "key 'api_key_env': not an environment variable name",
    }
    for text, message in bad.items():
        (tmp_path / "bad.yaml").write_text(server + text)
        with pytest.raises(TeacherSpecError, match=message) as err:
            load_teacher_spec(tmp_path / "bad.yaml")
        assert "s3cret" not in str(err.value)  # a key pasted in by mistake is not printed
    (tmp_path / "bad.yaml").write_text(f"name: t\nmodel: m\napi_key_env: {KEY_VARIABLE}\n")
    with pytest.raises(TeacherSpecError, match="key 'api_key_env': names the key of a vllm_server teacher's "
                                               "servers; backend transformers contacts no server"):
        load_teacher_spec(tmp_path / "bad.yaml")


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.0.1.1", True), ("::1", True),
                                                ("localhost", True), ("0.0.0.0", False), ("::", False),
                                                ("10.0.0.5", False), ("node7", False)])
def test_loopback_hosts(host, loopback):
    from turnopd.commands.teacher import is_loopback

    assert is_loopback(host) is loopback


def test_teacher_serve_refuses_a_reachable_host_without_a_key(tmp_path, monkeypatch, capsys):
    """Checked before vLLM is started: the spec's model folder is missing, so a serve that passes the
    host check stops at that error instead (the keyed server itself: tests/teachers/test_vllm_teachers.py)."""
    from turnopd.cli import main

    server = f"name: t\nmodel: {tmp_path / 'no-model'}\nbackend: vllm_server\nurl: http://127.0.0.1:9\n"
    (tmp_path / "open.yaml").write_text(server)
    (tmp_path / "keyed.yaml").write_text(server + f"api_key_env: {KEY_VARIABLE}\n")
    monkeypatch.delenv(KEY_VARIABLE, raising=False)

    def serve(spec: str, *flags: str) -> str:
        assert main(["teacher", "serve", str(tmp_path / spec), *flags]) == 2
        return capsys.readouterr().err

    err = serve("open.yaml", "--host", "0.0.0.0")
    assert err.startswith("error: teacher t: --host 0.0.0.0 can be reached from other machines, and the spec names "
                          "no API key") and "api_key_env" in err and "--insecure" in err
    assert "model directory not found" in serve("open.yaml", "--host", "0.0.0.0", "--insecure")
    assert "model directory not found" in serve("open.yaml", "--host", "127.0.0.1")
    assert f"the environment variable {KEY_VARIABLE} is not set" in serve("keyed.yaml", "--host", "0.0.0.0")
    monkeypatch.setenv(KEY_VARIABLE, "s3cret")
    assert "model directory not found" in serve("keyed.yaml", "--host", "0.0.0.0")


def test_every_teacher_backend_is_a_teacher_with_its_capabilities_declared():
    """The capabilities the pre-flight checks and the scoring read (teachers.base.Teacher) have their
    default there; every backend subclasses it, so each reads without a fallback."""
    for name in TEACHER_BACKENDS.names():
        backend = TEACHER_BACKENDS.get(name)
        assert Teacher in backend.__mro__, name
        assert isinstance(backend.provides_model, bool) and isinstance(backend.scores_entropy, bool)
        assert backend.reads_screenshots is False  # a transformers teacher sets it once its model is loaded
    assert TEACHER_BACKENDS.get("transformers").max_topk(None) is None
