"""env.pool=ray on a real Ray cluster of two nodes on this machine (`ray start --head` and a second
`ray start --address=...`, each a process group of its own): real ALFWorld episodes through actors
play what the local pool plays, byte for byte; an actor killed mid-episode (SIGKILL to its process)
or hung (SIGSTOP) is handled as a local worker is; actors go where their resource request fits; a
pool without env.ray.address starts a local cluster and stops it; a 2-step distillation runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from envs import make_env_spec  # noqa: E402
from envs.demonstrations import play_experts  # noqa: E402
from envs.pool import EnvPool  # noqa: E402
from envs.ray_pool import RayWorkers  # noqa: E402
from tests.conftest import child_env, loop_models  # noqa: E402
from tests.envs.test_pool import ScriptedSpec, survives_a_killed_and_a_stopped_worker  # noqa: E402
from turnopd.config import EnvConfig, PolicyConfig, RayEnvConfig  # noqa: E402
from turnopd.core.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow

STARTED = "Ray runtime started"
START_TIMEOUT_S = 180
# this machine's test cluster only; every process of the test (pools, `turnopd distill`) sees it
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_node(log: Path, *args: str) -> subprocess.Popen:
    """`ray start ... --block` in a process group of its own, once it says the node runs."""
    with log.open("w") as out:
        node = subprocess.Popen(["ray", "start", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                                 "--object-store-memory=100000000", "--disable-usage-stats", "--block", *args],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while STARTED not in log.read_text():
        assert node.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[str]:
    """A head node (1 CPU) and a second node (1 CPU and 2 of a custom resource "sandbox"); its address."""
    logs = tmp_path_factory.mktemp("ray")
    port = _free_port()
    nodes: list[subprocess.Popen] = []
    with pytest.MonkeyPatch.context() as env:
        for key, value in RAY_ENV.items():
            env.setenv(key, value)
        try:
            nodes.append(_ray_node(logs / "head.log", "--head", f"--port={port}", "--include-dashboard=false"))
            address = f"127.0.0.1:{port}"
            nodes.append(_ray_node(logs / "node.log", f"--address={address}", '--resources={"sandbox": 2}'))
            yield address
        finally:
            for node in nodes:  # the cluster's processes are each `ray start`'s group; nothing there to save
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()


def ray_pool(spec, address: str | None, num_workers: int = 2, step_timeout_s: float = 120, **ray_config) -> EnvPool:
    return EnvPool(spec, num_workers, step_timeout_s,
                   workers=partial(RayWorkers, ray_config=RayEnvConfig(address=address, **ray_config)))


@pytest.fixture(scope="module")
def alfworld():
    return make_env_spec(EnvConfig(name="alfworld"))


def test_expert_episodes_are_the_local_pools_and_actors_spread_over_the_nodes(cluster, alfworld):
    tasks = alfworld.tasks("valid_unseen")[:4]
    with EnvPool(alfworld, num_workers=2, step_timeout_s=120) as pool:
        local = list(play_experts(alfworld, pool, tasks, max_turns=30))
    with ray_pool(alfworld, cluster) as pool:
        nodes = {pool.workers.where(w)[0] for w in range(2)}
        remote = list(play_experts(alfworld, pool, tasks, max_turns=30))
        assert pool.restarts == 0
    assert len(nodes) == 2  # one CPU each: one actor on each node
    assert [d.task_id for d in remote] == tasks and sum(d.won for d in remote) >= 3
    assert remote == local  # every observation, admissible list, action and ending


def test_greedy_rollouts_are_the_local_pools(cluster, alfworld, tiny_model_dir):
    """The rollout engine (async, per-slot requests) with a greedy policy: token for token the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turnopd.rollout import POLICY_BACKENDS, SamplingParams
    from turnopd.rollout.agent_loop import rollout

    config = EnvConfig(name="alfworld", max_turns=4, history_length=1, answer_format="action")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    policy = POLICY_BACKENDS.get("transformers")(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(),
                                                 PolicyConfig(), tokenizer=tok)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, stop=("</action>",))
    tasks = alfworld.tasks("valid_seen")[:3]
    played = {}
    for name, pool in (("local", EnvPool(alfworld, num_workers=2)), ("ray", ray_pool(alfworld, cluster))):
        with pool:
            played[name] = rollout(alfworld, pool, policy, tasks, env_config=config, sampling=sampling, probes=3)
    for got, want in zip(played["ray"], played["local"], strict=True):
        assert not got.env_error and got.depth == want.depth == 4
        assert [(t.observation, t.prompt_ids, t.action_ids, t.reward, t.invalid) for t in got.turns] == \
               [(t.observation, t.prompt_ids, t.action_ids, t.reward, t.invalid) for t in want.turns]


def test_a_killed_actor_ends_its_episodes_and_is_replaced(cluster, alfworld):
    """As tests/envs/test_pool.py's real ALFWorld pool: a killed actor's episodes end with the reason,
    a hung one times out, and the replacements play on."""
    with ray_pool(alfworld, cluster) as pool:
        survives_a_killed_and_a_stopped_worker(pool, alfworld, alfworld.tasks("valid_unseen")[:4],
                                               "env worker 1 died (Ray actor: its worker process has died)")


def test_actors_go_where_their_resources_are(cluster):
    with ray_pool(ScriptedSpec(), cluster, num_cpus=0, resources={"sandbox": 1}) as pool:
        placed = {pool.workers.where(w)[0] for w in range(2)}
        assert placed == {n["NodeID"] for n in ray.nodes() if n["Resources"].get("sandbox")}  # the second node
        assert [o.observation for o in pool.reset(["a", "b"])] == ["start a", "start b"]
    with pytest.raises(RuntimeError, match=r"env.pool=ray: 1 of 1 env worker actors did not start within "
                                           r"env.ray.start_timeout_s=3 s: each asks for \{'CPU': 0, 'gpu_box': 1\}"):
        ray_pool(ScriptedSpec(), cluster, num_workers=1, num_cpus=0, resources={"gpu_box": 1}, start_timeout_s=3)
    assert not ray.is_initialized()


def test_without_an_address_a_local_cluster_is_started_and_stopped(cluster):
    with ray_pool(ScriptedSpec(), None, num_workers=3) as pool:
        gcs = ray.get_runtime_context().gcs_address
        assert gcs.rsplit(":", 1)[1] != cluster.rsplit(":", 1)[1]  # not the test cluster
        assert [n["Resources"]["CPU"] for n in ray.nodes()] == [max(os.cpu_count(), 3)]  # room for 3 actors
        pool.reset(["a"])
        assert pool.step({0: "finish"})[0].won
    assert not ray.is_initialized()
    host, port = gcs.rsplit(":", 1)
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=5):
        pass  # its GCS is gone with it


def test_two_distillation_steps_with_env_actors(cluster, tmp_path_factory, tiny_model_dir):
    recipe = ("name: ray\ndepth: {{warmup_steps: 1, probe_every: 1, min_successes: 1}}\n"
              "trainer: {{steps: 2, episodes_per_step: 2, lr: 1.0e-3}}\neval: {{max_tasks: 1, at_start: false}}\n")
    models = loop_models(tmp_path_factory.mktemp("ray-distill"), tiny_model_dir, recipe)
    env = child_env()
    records = {}
    for pool in ("local", "ray"):
        run = subprocess.run([sys.executable, "-m", "turnopd.cli", "distill", str(models / "recipe.yaml"),
                              f"name={pool}", f"env.pool={pool}", f"env.ray.address={cluster}"],
                             env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        print(run.stderr[-5000:])
        records[pool] = [r for r in read_metrics(models / "runs" / pool / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in records["ray"]] == [1, 2]
    assert all(r["env_failures"] == 0 for r in records["ray"])
    for got, want in zip(records["ray"], records["local"], strict=True):  # the same episodes, so the same step
        assert (got["tokens_generated"], got["env_steps"]) == (want["tokens_generated"], want["env_steps"])
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert "pool: ray" in (models / "runs" / "ray" / "config.yaml").read_text()
