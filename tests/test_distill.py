"""The distillation loop end to end on real ALFWorld games with tiny models: records, checkpoints,
kill -9 and resume, and the checks that run before any heavy work."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import turnopd
from tests.conftest import child_env, loop_models
from tests.test_faults import fill, small_disk
from turnopd.config import RecipeError
from turnopd.core.checkpoint import list_checkpoints
from turnopd.core.metrics import read_metrics
from turnopd.core.source import code_fingerprint
from turnopd.models import weights_fingerprint
from turnopd.orchestration.distill import run_distillation
from turnopd.orchestration.pipeline import sample_tasks
from turnopd.orchestration.preflight import check_resume_config, dry_run
from turnopd.orchestration.recipe import load_recipe

RECIPE = """
name: loop
depth: {{warmup_steps: 1, probe_every: 2, num_probes: 2, min_successes: 1}}
trainer: {{steps: 4, episodes_per_step: 2, lr: 1.0e-3}}
eval: {{max_tasks: 1}}
checkpoint: {{every: 1, keep_last: 5}}
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir):
    """A teacher (the session's tiny model) and a differently-initialized student sharing its tokenizer."""
    return loop_models(tmp_path_factory.mktemp("loop"), tiny_model_dir, RECIPE)


def test_sample_tasks_is_a_pure_function_of_seed_step_and_salt():
    tasks = [f"t{i}" for i in range(10)]
    a = sample_tasks(tasks, 4, seed=1, step=3, salt=0)
    assert a == sample_tasks(tasks, 4, seed=1, step=3, salt=0)
    assert len(set(a)) == 4  # without replacement while the split is large enough
    assert a != sample_tasks(tasks, 4, seed=1, step=4, salt=0)
    assert len(sample_tasks(tasks, 25, seed=1, step=0, salt=0)) == 25  # with replacement past the split


def test_checks_before_heavy_work(models, tmp_path):
    recipe = models / "recipe.yaml"
    with pytest.raises(RecipeError, match="'student.path'.*is not a local folder.*or set 'student.prepare'"):
        run_distillation(load_recipe(recipe, [f"student.path={tmp_path}/nope"]))
    with pytest.raises(RecipeError, match="split 'train' has 0 tasks and 'valid_seen' has 0 after"):
        run_distillation(load_recipe(recipe, ["env.max_tasks=0"]))
    with pytest.raises(ValueError, match=r"unknown ALFWorld task types \['no_such_type'\]; allowed: pick_and"):
        run_distillation(load_recipe(recipe, ["env.task_types=[no_such_type]"]))
    assert dry_run(load_recipe(recipe))["dry_run"]


def test_resume_refuses_a_different_recipe(models, tmp_path):
    cfg = load_recipe(models / "recipe.yaml")
    from turnopd.config import to_yaml

    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    check_resume_config(tmp_path, cfg)
    with pytest.raises(RecipeError, match=r"differs from the run's config.yaml in \['trainer'\]"):
        check_resume_config(tmp_path, load_recipe(models / "recipe.yaml", ["trainer.lr=0.5"]))
    # a run written before the tracker section existed resumes while the recipe leaves it at its defaults
    saved = OmegaConf.create(to_yaml(cfg))
    del saved["tracker"]
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    check_resume_config(tmp_path, cfg)
    with pytest.raises(RecipeError, match=r"differs from the run's config.yaml in \['tracker'\]"):
        check_resume_config(tmp_path, load_recipe(models / "recipe.yaml", ["tracker.group=g"]))


def _distill(models: Path, *args: str, env_extra: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    env = {**child_env(), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "turnopd.cli", "distill", str(models / "recipe.yaml"), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _wait_for(run: subprocess.Popen, checkpoint: Path) -> None:
    """Until `checkpoint` exists; the run must still be running (at most 900 s)."""
    deadline = time.time() + 900
    while not checkpoint.exists():
        assert run.poll() is None and time.time() < deadline, f"run ended before {checkpoint.name}"
        time.sleep(0.05)


def _kill_at_checkpoint(run: subprocess.Popen, run_dir: Path, step: int) -> None:
    """SIGKILL the run's process group as soon as checkpoint `step` exists (while the next step runs)."""
    _wait_for(run, run_dir / "checkpoints" / f"step_{step:06d}")
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()


@pytest.fixture(scope="module")
def uninterrupted(models) -> tuple[Path, str]:
    """Run A: the recipe's 4 steps, uninterrupted (its folder and printed output)."""
    a = _distill(models, "name=uninterrupted")
    out_a, _ = a.communicate(timeout=900)
    assert a.returncode == 0, out_a
    return models / "runs" / "uninterrupted", out_a


def _assert_same_steps(run: Path, reference: list[dict]) -> None:
    """Same tasks, seeds, weights, optimizer and controller state: each step equals the reference's."""
    train = _train_records(run)
    assert [r["step"] for r in train] == [r["step"] for r in reference]  # no duplicate, no lost step
    for ra, rb in zip(reference, train, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-7)
        assert rb["tokens_generated"] == ra["tokens_generated"]
        assert rb["rollout_depth_cap"] == ra["rollout_depth_cap"]


@pytest.mark.slow
def test_run_records_then_kill_and_resume_continue_exactly(models, uninterrupted):
    # Run A: uninterrupted. Run B: SIGKILL while step 3 runs (after checkpoint 2), then --resume.
    run_a, out_a = uninterrupted
    records = read_metrics(run_a / "metrics.jsonl")
    kinds = [r["kind"] for r in records]
    assert kinds == ["start", "eval", "train", "train", "train", "train", "eval"]
    # which builds it distilled: the student's and the teacher's folders, fingerprinted (the teacher
    # differs from the student, both have weights)
    models_used = records[0]["models"]
    assert models_used["student"]["path"] == str(models / "student")
    assert models_used["student"]["weights"] == weights_fingerprint(models / "student") is not None
    teacher_weights = weights_fingerprint(models_used["teacher:alfworld"]["path"])
    assert models_used["teacher:alfworld"]["weights"] == teacher_weights not in (None, models_used["student"]["weights"])
    # and which build of the code: the package's files as this test reads them (the run's child imports them)
    assert records[0]["code"] == {"version": turnopd.__version__, "source": code_fingerprint()}
    train = _train_records(run_a)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["probed"] for r in train] == [False, True, False, True]  # warm-up 1, then every 2
    assert [r["alpha"] for r in train] == [0.25, 0.5, 0.75, 1.0]  # linear k/K, k the step 1..K
    assert all(r["rollout_depth_cap"] <= 3 and r["episodes"] == 2 for r in train)
    clocks = [r["train_time_s"] for r in train]
    assert clocks == sorted(clocks) and all(r["wall_time_s"] >= r["train_time_s"] for r in train)
    # the memory high-water mark so far: a run's process holds torch and two models (> 100 MiB); never falls
    peaks = [r["peak_memory_mib"]["host"] for r in train]
    assert peaks == sorted(peaks) and peaks[0] > 100
    assert "held-out success" in out_a and "student after" in out_a
    assert sorted(p.name for p in (run_a / "checkpoints").iterdir()) == [f"step_{k:06d}" for k in (1, 2, 3, 4)]
    assert json.loads((run_a / "checkpoints" / "step_000004" / "loop_state.json").read_text())["step"] == 4

    run_b = models / "runs" / "killed"
    _kill_at_checkpoint(_distill(models, "name=killed", start_new_session=True), run_b, 2)
    assert [r["step"] for r in _train_records(run_b)][:2] == [1, 2]

    resumed = _distill(models, "name=killed", "--resume", str(run_b))
    out_b, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out_b
    assert "resuming" in out_b and "from step 2" in out_b
    _assert_same_steps(run_b, train)
    train_b = _train_records(run_b)
    # the training clock continues from the checkpoint instead of restarting at zero
    assert train_b[2]["train_time_s"] > train_b[1]["train_time_s"]

    # A torn latest checkpoint (its files cut to half, as by a full disk): resume passes over it with a
    # warning and continues from the one before, so step 4 is trained again, to the same loss.
    for f in (run_b / "checkpoints" / "step_000004").rglob("*"):
        if f.is_file() and f.name != "loop_state.json":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    again = _distill(models, "name=killed", "--resume", str(run_b))
    out_c, _ = again.communicate(timeout=900)
    assert again.returncode == 0, out_c
    assert "step_000004 cannot be read" in out_c and "from step 3" in out_c
    train_c = _train_records(run_b)
    assert [r["step"] for r in train_c] == [1, 2, 3, 4]
    assert train_c[3]["loss"] == pytest.approx(train[3]["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
def test_a_requeued_command_with_resume_auto_continues_the_killed_run_and_leaves_a_complete_one(models, uninterrupted):
    """A scheduler requeues the same command line with TURNOPD_RESUME=auto: the killed run continues
    from its checkpoint to the uninterrupted run's losses; once complete, the command trains nothing
    and exits 0."""
    run_dir, requeue = models / "runs" / "requeued", {"TURNOPD_RESUME": "auto"}
    _kill_at_checkpoint(_distill(models, "name=requeued", env_extra=requeue, start_new_session=True), run_dir, 2)
    resumed = _distill(models, "name=requeued", env_extra=requeue)
    out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out
    assert f"resuming {run_dir} from step 2" in out and not (models / "runs" / "requeued-2").exists()
    _assert_same_steps(run_dir, _train_records(uninterrupted[0]))
    records = (run_dir / "metrics.jsonl").read_text()
    again = _distill(models, "name=requeued", "--resume", "auto")
    out, _ = again.communicate(timeout=900)
    assert again.returncode == 0, out
    assert f"the newest run named 'requeued', {run_dir}, is complete" in out and "resuming" not in out
    assert (run_dir / "metrics.jsonl").read_text() == records


def _wait_for_step(run: subprocess.Popen, run_dir: Path, step: int) -> None:
    """Until the train record of `step` is written (the next step is under way); the run must still run."""
    deadline = time.time() + 900
    while not ((run_dir / "metrics.jsonl").exists() and step in [r["step"] for r in _train_records(run_dir)]):
        assert run.poll() is None and time.time() < deadline, f"run ended before step {step}"
        time.sleep(0.05)


def _stopped_step(out: str, signame: str, command: str, run_dir: Path) -> int:
    """The step the run's one stop line names; the line names the checkpoint of that step and the
    exact command that continues the run."""
    [line] = [line for line in out.splitlines() if line.startswith(f"stopped by {signame} after step ")]
    step = int(line.split(" after step ")[1].split(" ")[0])
    assert line == (f"stopped by {signame} after step {step} of 4; checkpoint {run_dir}/checkpoints/step_{step:06d}; "
                    f"continue with `{command} --resume {run_dir}`")
    return step


@pytest.mark.slow
@pytest.mark.parametrize("signum, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_stop_signal_ends_the_run_at_a_step_boundary_with_a_checkpoint_and_resume_loses_nothing(
        models, uninterrupted, signum, to_group):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) and a scheduler's SIGTERM (to
    the run's process): the step under way ends, a checkpoint of it is written (checkpoint.every 0:
    there is no other), one line names it and the resume command, no traceback from the run or its
    env workers, the conventional exit code; resuming ends with the uninterrupted run's losses."""
    name = f"stopped-{signal.Signals(signum).name}"
    run_dir = models / "runs" / name
    run = _distill(models, f"name={name}", "checkpoint.every=0", start_new_session=True)
    _wait_for_step(run, run_dir, 1)
    (os.killpg if to_group else os.kill)(run.pid, signum)
    out, _ = run.communicate(timeout=900)
    assert run.returncode == 128 + signum, out
    command = f"turnopd distill {models / 'recipe.yaml'} name={name} checkpoint.every=0"
    step = _stopped_step(out, signal.Signals(signum).name, command, run_dir)
    assert 1 <= step < 4 and _checkpoints(run_dir) == [f"step_{step:06d}"]
    assert "Traceback" not in out and "EOFError" not in out
    assert [r["step"] for r in _train_records(run_dir)] == list(range(1, step + 1))

    resumed = _distill(models, f"name={name}", "checkpoint.every=0", "--resume", str(run_dir))
    out_resumed, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out_resumed
    _assert_same_steps(run_dir, _train_records(uninterrupted[0]))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_a_training_budget_ends_the_run_within_one_episode_of_it(models, uninterrupted, mode):
    """trainer.budget in env steps: the run trains the uninterrupted run's first step, then a last step
    that plays only the episodes the budget leaves room for, so it ends at most one episode's env
    steps (env.max_turns, 3) past the budget; it says so in a record (the work achieved), then
    evaluates and checkpoints as at a last step; resuming it trains nothing more. one_step_off plans
    the next batch while a step trains, on the budget that step cannot spend."""
    reference = _train_records(uninterrupted[0])
    budget = reference[0]["env_steps"] + 1  # 1 env step left after step 1: step 2 plays one episode (its probe)
    run_dir = models / "runs" / f"budget-{mode}"
    args = (f"name=budget-{mode}", f"pipeline.mode={mode}", "trainer.budget.unit=env_steps",
            f"trainer.budget.amount={budget}", *(["objective.clip_eps=0.2"] if mode == "one_step_off" else []))
    run = _distill(models, *args)
    out, _ = run.communicate(timeout=900)
    assert run.returncode == 0, out
    records = read_metrics(run_dir / "metrics.jsonl")
    train = _train_records(run_dir)
    spent = sum(r["env_steps"] for r in train)
    assert [r["kind"] for r in records] == ["start", "eval", "train", "train", "budget_reached", "eval"]
    assert [(r["episodes"], r["probes"]) for r in train] == [(2, 0), (1, 1)]
    assert budget <= spent <= budget + 3  # at most one episode's 3 env steps past it (before: a whole step)
    assert records[4] == {"kind": "budget_reached", "step": 2, "unit": "env_steps", "amount": budget, "spent": spent}
    assert f"training budget reached at step 2: {spent} of {budget} env_steps" in out
    assert records[-1]["step"] == 2  # the final evaluation, at the last step trained
    # step 1 is the uninterrupted run's (the same tasks and weights: one_step_off's first batch is too)
    assert train[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-5, abs=1e-7)
    assert list_checkpoints(run_dir)[-1].name == "step_000002"
    again = _distill(models, *args, "--resume", str(run_dir))
    out_again, _ = again.communicate(timeout=900)
    assert again.returncode == 0, out_again
    assert [r["step"] for r in _train_records(run_dir)] == [1, 2]  # nothing left to train


def _checkpoints(run_dir: Path) -> list[str]:
    """Every folder under checkpoints/, hidden ones (a write or delete cut short) included."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_sigkill_at_each_failpoint_then_resume_loses_nothing(models, uninterrupted):
    """SIGKILL (TURNOPD_FAILPOINTS, turnopd.core.faults) in the middle of a step's rollout, before the
    optimizer step, inside a checkpoint write with the files written and with the folder complete
    but not renamed: each resume continues from the last complete checkpoint, and the run ends with
    the uninterrupted run's steps and losses."""
    run = models / "runs" / "failpoints"

    def launch(failpoint: str | None, *resume: str) -> int:
        """The run's exit code (-9 when the failpoint killed it); its output is printed for a failure's report."""
        proc = _distill(models, "name=failpoints", *resume, start_new_session=True,
                        env_extra={"TURNOPD_FAILPOINTS": failpoint} if failpoint else {})
        print(proc.communicate(timeout=900)[0][-3000:])
        return proc.returncode

    # the eval at step 0 plays 1 episode, step 1 two: the 4th is the first to end in step 2's rollout
    assert launch("rollout.episode_done@4=kill") == -signal.SIGKILL
    assert [r["step"] for r in _train_records(run)] == [1] and _checkpoints(run) == ["step_000001"]

    # resumed at 1: step 2 trains and is checkpointed, step 3 dies with its gradients accumulated
    assert launch("trainer.optimizer_step@2=kill", "--resume", str(run)) == -signal.SIGKILL
    assert [r["step"] for r in _train_records(run)] == [1, 2]
    assert _checkpoints(run) == ["step_000001", "step_000002"]

    # resumed at 2: step 3's record is written, its checkpoint dies with the trainer's files written
    assert launch("checkpoint.files_written=kill", "--resume", str(run)) == -signal.SIGKILL
    assert [r["step"] for r in _train_records(run)] == [1, 2, 3]
    assert _checkpoints(run) == [".tmp-step_000003", "step_000001", "step_000002"]

    # resumed at 2 again (step 3's record dropped): checkpoint 3 complete in its temporary folder, not renamed
    assert launch("checkpoint.before_rename=kill", "--resume", str(run)) == -signal.SIGKILL
    assert (run / "checkpoints" / ".tmp-step_000003" / "loop_state.json").is_file()
    assert [p.name for p in list_checkpoints(run)] == ["step_000001", "step_000002"]

    assert launch(None, "--resume", str(run)) == 0
    _assert_same_steps(run, _train_records(uninterrupted[0]))
    assert _checkpoints(run) == [f"step_{k:06d}" for k in (1, 2, 3, 4)]  # the leftovers removed
    starts = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "start"]
    assert [r["resumed_from_step"] for r in starts] == [0, 1, 2, 2, 2]


def _fill_when(run: subprocess.Popen, checkpoint: Path, disk: Path, leave_bytes: int) -> Path:
    """Once `checkpoint` exists: stop the run (SIGSTOP), fill its disk to `leave_bytes` free, let it go on."""
    _wait_for(run, checkpoint)
    os.kill(run.pid, signal.SIGSTOP)
    try:
        return fill(disk, leave_bytes)
    finally:
        os.kill(run.pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_disk_that_fills_stops_the_run_clearly_and_resume_loses_nothing(models, uninterrupted, tmp_path):
    """The run folder on a 64 MB tmpfs that fills while the run writes. First 256 KB are left after
    checkpoint 1: step 2's record fits, its checkpoint does not. Then the disk is full to the last
    page when the run is resumed: the resume's first write (metrics.jsonl without the records past
    the checkpoint) fails. Each time the run stops with the message and the --resume command, no
    traceback, metrics.jsonl complete and no partial checkpoint left; once space is freed, --resume
    ends the run with the uninterrupted run's steps and losses."""
    with small_disk(tmp_path / "disk", "64m") as disk:
        args = ("name=full", f"output_dir={disk}")
        run = disk / "full"

        first = _distill(models, *args)
        filler = _fill_when(first, run / "checkpoints" / "step_000001", disk, leave_bytes=256 * 1024)
        out, _ = first.communicate(timeout=900)
        assert first.returncode == 1, out
        assert (f"error: the run stopped: no space left on the disk holding {run}/checkpoints/step_000002: checkpoint "
                "step_000002 could not be written") in out, out
        assert "its partial folder was removed, and the last complete checkpoint is step_000001" in out
        assert f"Free space, then continue the run with --resume {run}" in out and "Traceback" not in out
        assert [r["step"] for r in _train_records(run)] == [1, 2] and _checkpoints(run) == ["step_000001"]
        filler.unlink()

        metrics = (run / "metrics.jsonl").read_bytes()
        filler = fill(disk)
        full = _distill(models, *args, "--resume", str(run))
        out, _ = full.communicate(timeout=900)
        assert full.returncode == 1, out
        assert (f"no space left on the disk holding {run}/metrics.jsonl: its records past step 1 could not be dropped "
                "(the file is unchanged)") in out and "Traceback" not in out, out
        assert (run / "metrics.jsonl").read_bytes() == metrics and not (run / "metrics.jsonl.tmp").exists()
        filler.unlink()

        last = _distill(models, *args, "--resume", str(run))
        out, _ = last.communicate(timeout=900)
        assert last.returncode == 0, out
        _assert_same_steps(run, _train_records(uninterrupted[0]))


def _torchrun(launcher: list[str], models: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "turnopd.cli", "distill",
            str(models / "recipe.yaml"), f"name={name}", "checkpoint.every=2"]


@pytest.mark.slow
def test_data_parallel_under_torchrun(models):
    """Two gloo processes under torchrun: one run folder, a step's episodes split between the ranks
    (episodes_per_step is global), evaluation tasks sharded and gathered. Then the same as two
    "nodes" of one process each (two torchrun launches, --nnodes 2 with --node-rank 0 and 1 and a
    static rendezvous on 127.0.0.1, as on a cluster): the same losses."""
    out = subprocess.run(_torchrun(["--nproc-per-node", "2"], models, "dp"), env=child_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = read_metrics(models / "runs" / "dp" / "metrics.jsonl")
    assert records[0]["world_size"] == 2
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    # probes (num_probes 2) at steps 2 and 4 (probe_every 2), rollouts (episodes_per_step 2) otherwise
    assert [r["episodes"] for r in train] == [2, 2, 2, 2]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["step"], r["num_tasks"]) for r in evals] == [(0, 1), (4, 1)]
    assert sorted(p.name for p in (models / "runs" / "dp" / "checkpoints").iterdir()) == ["step_000002", "step_000004"]

    # SIGTERM to torchrun, which passes it to both ranks: they stop at the same step boundary (the
    # checkpoint every 2 steps, or the one written on stop), and resuming gives the uninterrupted losses
    stopped_dir = models / "runs" / "dp-stopped"
    stopped = subprocess.Popen(_torchrun(["--nproc-per-node", "2"], models, "dp-stopped"), env=child_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_step(stopped, stopped_dir, 1)
    stopped.send_signal(signal.SIGTERM)
    out_stopped, _ = stopped.communicate(timeout=900)
    command = f"turnopd distill {models / 'recipe.yaml'} name=dp-stopped checkpoint.every=2"
    [line] = [line for line in out_stopped.splitlines() if line.startswith("stopped by SIGTERM")]
    step = int(line.split(" after step ")[1].split(" ")[0])
    assert line.endswith(f"continue with `{command} --resume {stopped_dir}` (under the same torchrun launch)")
    assert [r["step"] for r in _train_records(stopped_dir)] == list(range(1, step + 1))  # one record per step
    assert _checkpoints(stopped_dir)[-1] == f"step_{step:06d}"
    resumed = subprocess.run([*_torchrun(["--nproc-per-node", "2"], models, "dp-stopped"), "--resume", str(stopped_dir)],
                             env=child_env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    _assert_same_steps(stopped_dir, train)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = [subprocess.Popen(_torchrun(["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                                         "--master-addr", "127.0.0.1", "--master-port", str(port)], models, "two-nodes"),
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    two_nodes = read_metrics(models / "runs" / "two-nodes" / "metrics.jsonl")
    assert two_nodes[0]["world_size"] == 2
    train_nodes = [r for r in two_nodes if r["kind"] == "train"]
    assert [r["step"] for r in train_nodes] == [1, 2, 3, 4]
    assert [r["loss"] for r in train_nodes] == pytest.approx([r["loss"] for r in train], rel=1e-5, abs=1e-7)
    assert [r["tokens_trained"] for r in train_nodes] == [r["tokens_trained"] for r in train]


@pytest.mark.slow
def test_a_resume_on_another_world_size_is_refused_at_start(models, uninterrupted):
    """Checkpoints of 2 ranks are not resumed by 1, nor those of 1 by 2 (each rank's optimizer partition
    and RNG state are its own, docs/cluster.md): refused at start, naming both sizes, the run untouched."""
    two_ranks = [*_torchrun(["--nproc-per-node", "2"], models, "two-ranks"), "trainer.steps=2"]
    out = subprocess.run(two_ranks, env=child_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = models / "runs" / "two-ranks"
    records = (run_dir / "metrics.jsonl").read_text()
    one_rank = [sys.executable, "-m", "turnopd.cli", *two_ranks[two_ranks.index("distill"):], "--resume", str(run_dir)]
    out = subprocess.run(one_rank, env=child_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"error: --resume {run_dir}: its checkpoint step_000002 was written by 2 rank(s) and this launch has 1" in (
        out.stderr)
    assert (run_dir / "metrics.jsonl").read_text() == records

    run_a = uninterrupted[0]
    by_two = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "turnopd.cli", "distill",
              str(models / "recipe.yaml"), "name=uninterrupted", "--resume", str(run_a)]
    out = subprocess.run(by_two, env=child_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode != 0
    assert "its checkpoint step_000004 was written by 1 rank(s) and this launch has 2" in out.stdout + out.stderr



def test_a_step_the_env_ended_entirely_stops_the_run_naming_the_env_error(models, tmp_path):
    """Every training game is unreadable (as when a full disk cut the files short): each episode of
    step 1 ends at reset by the real engine's GameLoadError. The run stops before training, naming
    the env error and how to continue, instead of failing later on an empty batch."""
    from turnopd.core.data import resolve_data

    real = resolve_data("alfworld/json_2.1.1", None)
    data = tmp_path / "data" / "alfworld" / "json_2.1.1"
    for split in ("valid_seen", "valid_unseen", "valid_train"):
        data.mkdir(parents=True, exist_ok=True)
        (data / split).symlink_to(real / split)
    for game in sorted((real / "train").glob("look_at_obj_in_light-*/*/game.tw-pddl"))[:3]:
        broken = data / "train" / game.parent.relative_to(real / "train") / "game.tw-pddl"
        broken.parent.mkdir(parents=True)
        broken.write_text(game.read_text()[:100])  # the first 100 characters: not JSON any more
    out = _distill(models, "name=broken_env", f"data_dir={tmp_path / 'data'}", "eval.at_start=false")
    log, _ = out.communicate(timeout=600)
    assert out.returncode == 1, log
    assert "error: the run stopped: step 1: 2 of 2 episodes were ended by the env, not the agent: " \
           "GameLoadError: cannot load ALFWorld game" in log
    assert f"continue the run with --resume {models / 'runs' / 'broken_env'}" in log
    assert "Traceback" not in log
    assert [r["kind"] for r in read_metrics(models / "runs" / "broken_env" / "metrics.jsonl")] == ["start"]
