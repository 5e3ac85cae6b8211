"""The env pool: slots over workers, reuse across batches, and surviving crashed or hung workers.

`ScriptedSpec` is a stand-in env whose actions make a worker misbehave on demand (fast, exact); the
same failures are then caused from outside on the real ALFWorld engine (kill -9, SIGSTOP).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import pytest

from envs import make_env_spec
from envs.base import StepOutcome
from envs.pool import EnvPool
from tests.conftest import hide_package
from turnopd.config import EnvConfig


class ScriptedEnv:
    """Echoes actions; "finish" wins, "raise" raises, "crash" kills its process, "sleep:S" sleeps."""

    def reset(self, task_id: str) -> StepOutcome:
        self.task_id, self.steps = task_id, 0
        return StepOutcome(observation=f"start {task_id}", info={"pid": os.getpid()})

    def step(self, action: str) -> StepOutcome:
        self.steps += 1
        if action == "raise":
            raise ValueError("boom")
        if action == "crash":
            os._exit(3)
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":")[1]))
        won = action == "finish"
        return StepOutcome(observation=f"{self.task_id} step {self.steps}: {action}", done=won, won=won,
                           reward=float(won),
                           info={"pid": os.getpid(), "torch_loaded": "torch" in sys.modules})

    def close(self) -> None:
        pass


class ScriptedSpec:
    name = "scripted"
    default_max_turns = 10

    def make(self) -> ScriptedEnv:
        return ScriptedEnv()


def test_slots_spread_over_workers_and_batches_of_any_size() -> None:
    with EnvPool(ScriptedSpec(), num_workers=2, step_timeout_s=30) as pool:
        first = pool.reset(["a", "b", "c"])
        assert [o.observation for o in first] == ["start a", "start b", "start c"]
        # slot i lives in worker i % 2
        assert [o.info["pid"] for o in first] == [pool.pids[0], pool.pids[1], pool.pids[0]]
        out = pool.step({0: "go", 2: "go"})  # only the slots asked for
        assert sorted(out) == [0, 2]
        assert out[2].observation == "c step 1: go"
        assert out[0].info["torch_loaded"] is False  # workers stay light
        # a larger batch, then a smaller one, on the same workers
        second = pool.reset(["d", "e", "f", "g", "h"])
        assert [o.observation for o in second] == [f"start {t}" for t in "defgh"]
        out = pool.step({i: "finish" if i == 3 else "go" for i in range(5)})
        assert out[4].observation == "h step 1: go"  # a fresh episode in a slot that existed before
        assert (out[3].done, out[3].won, out[3].reward) == (True, True, 1.0)
        with pytest.raises(ValueError, match="slot 3 has no episode playing"):
            pool.step({3: "go"})
        pool.reset(["i"])
        with pytest.raises(ValueError, match="slot 1 has no episode playing"):
            pool.step({1: "go"})
        assert pool.step({0: "go"})[0].observation == "i step 1: go"
        assert pool.restarts == 0


def test_episodes_step_on_their_own_while_another_worker_is_busy() -> None:
    """The per-slot requests of the rollout engine: slot 1's slow step (worker 1) does not hold slot 0
    (worker 0), which plays three steps meanwhile; a slot's requests are answered in order."""
    async def play(pool: EnvPool) -> list[tuple[str, float]]:
        start = time.monotonic()
        await asyncio.gather(pool.reset_slot(0, "a"), pool.reset_slot(1, "b"))
        done: list[tuple[str, float]] = []

        async def steps(slot: int, actions: list[str]) -> None:
            for action in actions:
                outcome = await pool.step_slot(slot, action)
                done.append((outcome.observation, time.monotonic() - start))

        await asyncio.gather(steps(0, ["go", "go", "finish"]), steps(1, ["sleep:1.5"]))
        return done

    with EnvPool(ScriptedSpec(), num_workers=2, step_timeout_s=30) as pool:
        done = asyncio.run(play(pool))
        # slot 0 finished all three steps before slot 1's one step came back; a pool answering one
        # request at a time would have put b's step between a's (order, not a wall-clock bound)
        assert [o for o, _ in done] == ["a step 1: go", "a step 2: go", "a step 3: finish", "b step 1: sleep:1.5"]
        assert done[3][1] >= 1.5  # slot 1's step really slept
        with pytest.raises(ValueError, match="slot 0 has no episode playing"):
            pool.step({0: "go"})  # its episode ended with "finish"


def test_one_worker_is_still_a_process() -> None:
    with EnvPool(ScriptedSpec(), num_workers=1, step_timeout_s=30) as pool:
        outcomes = pool.reset(["a", "b"])
        assert {o.info["pid"] for o in outcomes} == {pool.pids[0]} != {os.getpid()}


def test_an_env_exception_ends_only_its_episode() -> None:
    with EnvPool(ScriptedSpec(), num_workers=2, step_timeout_s=30) as pool:
        pool.reset(["a", "b", "c"])
        out = pool.step({0: "raise", 1: "go", 2: "go"})
        assert (out[0].done, out[0].won, out[0].info["env_error"]) == (True, False, "ValueError: boom")
        assert out[2].observation == "c step 1: go"  # same worker, next slot: unaffected
        assert pool.restarts == 0


def test_a_crashed_worker_fails_its_episodes_and_restarts() -> None:
    with EnvPool(ScriptedSpec(), num_workers=2, step_timeout_s=30) as pool:
        pool.reset(["a", "b", "c", "d", "e"])  # worker 0: slots 0, 2, 4; worker 1: slots 1, 3
        old_pids = pool.pids
        out = pool.step({0: "go", 1: "go", 2: "crash", 3: "go"})  # slot 4 not stepped this round
        assert out[1].observation == "b step 1: go" and out[3].observation == "d step 1: go"
        # slot 0 answered before its worker died, but its episode died with it
        for slot in (0, 2):
            assert (out[slot].done, out[slot].won) == (True, False)
            assert out[slot].info["env_error"] == "env worker 0 died (exit code 3)"
        assert pool.restarts == 1
        assert pool.pids[0] != old_pids[0] and pool.pids[1] == old_pids[1]
        # slot 4 lived in the dead worker too: it fails when next stepped
        assert pool.step({4: "go", 1: "go"})[4].info["env_error"] == "env worker 0 died (exit code 3)"
        # the restarted worker plays the next batch
        assert [o.observation for o in pool.reset(["x", "y"])] == ["start x", "start y"]
        assert pool.step({0: "finish"})[0].won


def test_a_worker_killed_mid_step_fails_its_episodes() -> None:
    with EnvPool(ScriptedSpec(), num_workers=2, step_timeout_s=60) as pool:
        pool.reset(["a", "b"])
        victim = pool.pids[1]
        killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        out = pool.step({0: "go", 1: "sleep:30"})
        killer.join()
        assert time.monotonic() - start < 30  # not waiting for the sleep nor the 60 s timeout
        assert out[0].observation == "a step 1: go"
        assert out[1].info["env_error"] == f"env worker 1 died (exit code {-signal.SIGKILL})"
        assert pool.restarts == 1


def test_a_hanging_worker_times_out() -> None:
    # 5 s: long enough that a busy shared machine does not make the healthy worker look hung
    with EnvPool(ScriptedSpec(), num_workers=2, step_timeout_s=5.0) as pool:
        pool.reset(["a", "b", "c"])
        start = time.monotonic()
        out = pool.step({0: "go", 1: "sleep:3600", 2: "go"})
        assert time.monotonic() - start < 30
        assert out[1].info["env_error"] == "env worker 1 timed out after 5 s on a step"
        assert out[0].observation == "a step 1: go" and out[2].observation == "c step 1: go"
        assert pool.restarts == 1
        assert pool.step({0: "finish"})[0].won  # worker 0 never stopped
        assert pool.reset(["d", "e"])[1].observation == "start e"


def test_step_latency_holds_each_worker_for_every_request() -> None:
    # 0.4 s a request. Two workers, four slots (two per worker): a reset or step of all four takes
    # 2 requests x 0.4 s = 0.8 s per worker, the workers waiting side by side (a sandbox each).
    # Without the latency the scripted env answers in milliseconds.
    latency = 0.4
    with EnvPool(ScriptedSpec(), num_workers=2, step_timeout_s=30, step_latency_s=latency) as pool:
        pool.reset(["a", "b", "c", "d"])
        start = time.monotonic()
        out = pool.step({0: "go", 1: "go", 2: "go", 3: "finish"})
        elapsed = time.monotonic() - start
        assert out[3].won and out[0].observation == "a step 1: go"
        assert 2 * latency <= elapsed < 4 * latency  # side by side: not 4 x 0.4 s one after another
        start = time.monotonic()
        pool.step({0: "go"})
        assert latency <= time.monotonic() - start < 2 * latency
    with EnvPool(ScriptedSpec(), num_workers=2, step_timeout_s=30) as pool:
        pool.reset(["a", "b", "c", "d"])
        start = time.monotonic()
        pool.step({0: "go", 1: "go", 2: "go", 3: "go"})
        assert time.monotonic() - start < latency


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        EnvPool(ScriptedSpec(), num_workers=0)
    with pytest.raises(ValueError, match="step_timeout_s must be > 0"):
        EnvPool(ScriptedSpec(), num_workers=1, step_timeout_s=0)
    with pytest.raises(ValueError, match=r"step_latency_s must be in \[0, step_timeout_s = 5\), got 5"):
        EnvPool(ScriptedSpec(), num_workers=1, step_timeout_s=5, step_latency_s=5)


def survives_a_killed_and_a_stopped_worker(pool: EnvPool, spec, tasks: list[str], death: str) -> None:
    """On a 2-worker pool of real ALFWorld: worker 1 is stopped, then SIGKILLed while its step is in
    flight (its episodes end with `death`, the others play on and win); worker 0 hangs (SIGSTOP) and
    times out; the restarted workers play a fresh batch to the end. Shared with the Ray pool's test."""
    outcomes = pool.reset(tasks)
    experts = [spec.expert(t) for t in tasks]
    # worker 1 (slots 1 and 3) is stopped, then killed while its step is in flight
    victim = pool.pids[1]
    os.kill(victim, signal.SIGSTOP)
    killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    killer.start()
    out = pool.step({i: experts[i].act(outcomes[i]) for i in range(4)})
    killer.join()
    for slot in (1, 3):
        assert (out[slot].done, out[slot].won) == (True, False)
        assert out[slot].info["env_error"] == death
    # the other episodes go on to win
    live = {slot: out[slot] for slot in (0, 2)}
    for _ in range(50):
        live = pool.step({slot: experts[slot].act(o) for slot, o in live.items()})
        assert all("env_error" not in o.info for o in live.values())
        if all(o.done for o in live.values()):
            break
        live = {slot: o for slot, o in live.items() if not o.done}
    assert all(o.won for o in live.values())
    assert pool.restarts == 1 and pool.pids[1] != victim

    # a worker that stops answering (SIGSTOP: a hang the env cannot see) times out
    pool.reset(tasks[:2])
    pool.step_timeout_s = 5.0
    os.kill(pool.pids[0], signal.SIGSTOP)
    out = pool.step({0: "look", 1: "look"})
    assert out[0].info["env_error"] == "env worker 0 timed out after 5 s on a step"
    assert "env_error" not in out[1].info
    assert pool.restarts == 2

    # both restarted workers play a fresh batch to the end
    pool.step_timeout_s = 120.0
    experts = [spec.expert(t) for t in tasks[:2]]
    live = dict(enumerate(pool.reset(tasks[:2])))
    for _ in range(50):
        out = pool.step({slot: experts[slot].act(o) for slot, o in live.items()})
        live = {slot: o for slot, o in out.items() if not o.done}
        assert all(o.won for o in out.values() if o.done)
        if not live:
            break
    assert not live


@pytest.mark.slow
def test_real_alfworld_pool_survives_a_killed_and_a_stopped_worker() -> None:
    spec = make_env_spec(EnvConfig(name="alfworld"))
    with EnvPool(spec, num_workers=2, step_timeout_s=120) as pool:
        survives_a_killed_and_a_stopped_worker(pool, spec, spec.tasks("valid_unseen")[:4],
                                               "env worker 1 died (exit code -9)")


def test_env_pool_ray_is_a_recipe_choice_refused_without_ray(tmp_path, monkeypatch):
    from turnopd.config import RecipeError
    from turnopd.orchestration.recipe import load_recipe

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: t\nstudent: {path: x}\nteachers: {alfworld: t.yaml}\n")
    assert load_recipe(recipe).env.pool == "local"
    with pytest.raises(RecipeError, match=r"recipe key 'env.pool': 'sandbox' is not allowed; allowed: local, ray, inline"):
        load_recipe(recipe, ["env.pool=sandbox"])
    hide_package(monkeypatch, "ray")
    with pytest.raises(RecipeError, match=r"recipe key 'env.pool': 'ray' needs the ray package, which is not "
                                          r"installed: pip install 'turnopd\[ray\]' \(or env.pool=local\)"):
        load_recipe(recipe, ["env.pool=ray"])
