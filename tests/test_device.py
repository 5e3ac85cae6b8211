"""Device placement, decided in turnopd.core.device: the run's device under a launcher and without
one, a generator process pinned to its rank's GPU, and every model loader, backend and teacher
putting its model where it is told (the run's device by default). No GPU needed: CUDA's presence is
monkeypatched, and `meta` stands for a device other than the CPU."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import turnopd.loaders.hf_models as hf_models
import turnopd.loaders.vllm_engine as vllm_engine
from teachers import TeacherSpec, make_teacher
from turnopd.config import PolicyConfig
from turnopd.core.device import matmul_peak_flops, pin_process_to_local_gpu, run_device
from turnopd.loaders.hf_models import load_model, load_student
from turnopd.rollout import make_policy

META = torch.device("meta")


def parameter_devices(model: torch.nn.Module) -> set[torch.device]:
    return {p.device for p in model.parameters()}


def test_run_device_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert run_device() == torch.device("cpu")


def test_run_device_is_the_launchers_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert run_device() == torch.device("cuda", 3)


def test_run_device_is_the_current_gpu_without_a_launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert run_device() == torch.device("cuda")


@pytest.mark.parametrize(("visible", "pinned"), [(None, "1"), ("4,6", "6")])
def test_pinned_process_sees_its_ranks_gpu_alone_as_gpu_0(monkeypatch, visible, pinned):
    monkeypatch.setenv("LOCAL_RANK", "1")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    pin_process_to_local_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == pinned
    assert os.environ["LOCAL_RANK"] == "0"


def test_pinning_without_a_launcher_changes_nothing(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    pin_process_to_local_gpu()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and "LOCAL_RANK" not in os.environ


def test_matmul_peak_is_measured_on_the_given_device():
    assert 0 < matmul_peak_flops(torch.device("cpu"), torch.float32, size=64, repeats=2) < float("inf")


# In a fresh process (a test session's own peak may already be above anything a test allocates): its
# peak, then after it holds 300 MiB, then with a child of its own that holds 200 MiB (bytes * n writes
# every page, so all of it is resident).
PEAK_PROBE = """
import json, subprocess, sys, torch
from turnopd.core.device import peak_memory_mib
cpu = torch.device("cpu")
start = peak_memory_mib(cpu)
held = b"x" * (300 * 2**20)
own = peak_memory_mib(cpu)
child = subprocess.Popen([sys.executable, "-c", "b = b'x' * (200 * 2**20); print('ready', flush=True); input()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
child.stdout.readline()
with_child = peak_memory_mib(cpu)
child.communicate("")
print(json.dumps([start, own, with_child]))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the process tree's peaks are read from /proc")
def test_peak_memory_counts_this_process_and_the_ones_it_started():
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, check=True).stdout
    start, own, with_child = json.loads(out.splitlines()[-1])
    assert set(start) == {"host"}  # no cuda entry on the CPU
    # (each figure is rounded to 0.1 MiB)
    assert 300 - 0.2 <= own["host"] - start["host"] < 300 + 20  # the 300 MiB it holds, and little else
    # the child's peak: its 200 MiB and an interpreter's ~10-20 MiB
    assert 200 <= with_child["host"] - own["host"] < 200 + 40


def test_load_model_puts_the_model_on_the_given_device(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, "float32", device="meta")
    assert parameter_devices(model) == {META}


def test_loaders_default_to_the_runs_device(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(hf_models, "run_device", lambda: META)
    model, _ = load_model(tiny_model_dir, "float32")
    student, _ = load_student(tiny_model_dir, "float32")
    assert parameter_devices(model) == parameter_devices(student) == {META}


def test_load_student_puts_the_student_on_the_given_device(tiny_model_dir):
    student, _ = load_student(tiny_model_dir, "float32", device="cpu")
    assert parameter_devices(student) == {torch.device("cpu")}


def test_transformers_policy_loads_its_model_on_the_runs_device(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(hf_models, "run_device", lambda: META)
    policy = make_policy(PolicyConfig(), str(tiny_model_dir), dtype="float32")
    assert parameter_devices(policy.model) == {META}


def test_transformers_teacher_runs_on_its_device_option(tiny_model_dir):
    teacher = make_teacher(TeacherSpec(name="t", model=str(tiny_model_dir), dtype="float32", options={"device": "meta"}))
    assert teacher.device == META and parameter_devices(teacher.model) == {META}
    assert teacher.max_batch_tokens == 2048  # not a GPU: the CPU's bound on the logits


def test_transformers_teacher_takes_larger_batches_on_a_gpu(tiny_model_dir, monkeypatch):
    import teachers.transformers_teacher as teacher_module

    monkeypatch.setattr(teacher_module, "run_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(teacher_module, "load_model", lambda *args, device, **kw: load_model(*args, device="cpu", **kw))
    teacher = make_teacher(TeacherSpec(name="t", model=str(tiny_model_dir), dtype="float32"))
    assert teacher.device == torch.device("cuda", 1)
    assert teacher.max_batch_tokens == teacher_module.GPU_MAX_BATCH_TOKENS
    spec = TeacherSpec(name="t", model=str(tiny_model_dir), dtype="float32", options={"max_batch_tokens": 512})
    assert make_teacher(spec).max_batch_tokens == 512  # the spec's own choice wins


@pytest.mark.parametrize(("cuda", "world", "expected"), [
    (True, 2, {"distributed_executor_backend": "external_launcher"}),  # a torchrun rank: its own GPU
    (True, 1, {}),  # one process: vLLM's default executor, GPU 0
    (True, None, {}),  # outside the launcher's group (a pipeline generator): its own world
    (False, 2, {}),  # CPU ranks: no GPU to choose
])
def test_vllm_engines_of_launched_ranks_use_the_external_launcher(monkeypatch, cuda, world, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: world is not None)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)
    assert vllm_engine.placement_args() == expected


def test_vllm_gets_a_loopback_host_address_unless_one_is_set(monkeypatch):
    for key in vllm_engine.VLLM_ENV_DEFAULTS:  # set, then unset: the test's end restores each as it was
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("VLLM_HOST_IP", "10.0.0.7")
    with contextlib.suppress(ImportError):  # where vLLM is not installed the variables are set all the same
        vllm_engine.import_vllm()
    assert os.environ["VLLM_HOST_IP"] == "10.0.0.7"
    monkeypatch.delenv("VLLM_HOST_IP")
    with contextlib.suppress(ImportError):
        vllm_engine.import_vllm()
    assert os.environ["VLLM_HOST_IP"] == "127.0.0.1"
