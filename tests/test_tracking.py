"""Experiment trackers (turnopd.core.tracking): each one's output read back with its own library's
reader, the recipe checks of `tracking`, and a short distillation logging to all three."""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import hide_package, loop_models
from turnopd.config import RecipeError
from turnopd.core.metrics import read_metrics
from turnopd.core.tracking import TRACKERS, TrackedRun, TrackerSettings, saved_id, wandb_mode

CONFIG = {"name": "tracked", "seed": 3, "trainer": {"lr": 0.001, "betas": [0.9, 0.999]}, "env": {"options": {}}}
URL = "http://10.0.0.1:8000"  # a teacher replica's URL: characters MLflow names do not allow


def train_record(step: int) -> dict[str, Any]:
    return {"kind": "train", "step": step, "loss": 1.0 / step, "phases": {"rollout": 0.5 * step, "train": 0.25},
            "probed": step % 2 == 0, "h_eff": None, "turn_kl_profile": [0.1, 0.2],
            "pipeline": {"mode": "sync", "staleness_max": step}, "env_errors": {},
            "teacher_replicas": {"tiny": {URL: {"requests": 2 * step}}}}


EVAL = {"kind": "eval", "step": 3, "split": "valid_seen", "k": 1, "avg_at_k": 0.25, "num_tasks": 4,
        "per_type": {"pick": 0.5}, "per_task": {"task-1": 1.0}}
STEPS = (1, 2, 3)


def feed(run: TrackedRun, name: str, plot: Path) -> None:
    tracker = TRACKERS.get(name)(run)
    for step in STEPS:
        tracker.log_record(train_record(step), step)
    tracker.log_eval("eval", EVAL, 3)
    tracker.log_image("frontier", plot, 3)
    tracker.close()


@pytest.fixture
def plot(tmp_path: Path) -> Path:
    from PIL import Image

    path = tmp_path / "frontier.png"
    Image.new("RGB", (8, 6), (200, 10, 10)).save(path)
    return path


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    """No W&B credentials anywhere and WANDB_MODE unset: a wandb tracker runs offline."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "NETRC", "WANDB_DIR", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()


@pytest.fixture
def local_mlflow(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # unset for the test and restored after it: the tracker sets it for its local store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


# ---- readers -----------------------------------------------------------------------------------------


def tensorboard_scalars(folder: Path) -> tuple[dict[str, dict[int, float]], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert all(len({step for step, _ in events}) == len(events) for events in scalars.values()), scalars
    return {tag: dict(events) for tag, events in scalars.items()}, acc.Tags()["images"]


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a .wandb transaction log (a LevelDB-style log: a 7-byte header, then
    32 KiB blocks of chunks, each with a crc32, length and type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_wandb_logs(run_dir: Path, runs: int, timeout_s: float = 30.0) -> list[list[Any]]:
    """The records of the `runs` offline runs under run_dir/wandb, oldest first, once each log ends
    with its exit record: wandb-core writes the log in a process of its own, and run.finish() may
    return before the newest log is complete on disk."""
    deadline = time.monotonic() + timeout_s
    while True:
        logs = [wandb_records(log) for log in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))]
        if len(logs) == runs and all(log and log[-1].WhichOneof("record_type") == "exit" for log in logs):
            return logs
        assert time.monotonic() < deadline, f"{runs} finished wandb offline runs expected, found {len(logs)}"
        time.sleep(0.1)


def wandb_history(run_dir: Path, runs: int = 1) -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
    """History rows, config and run ids of the `runs` offline runs under run_dir/wandb."""
    rows, config, ids = [], {}, []
    for log in finished_wandb_logs(run_dir, runs):
        for record in log:
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif kind == "run":
                ids.append(record.run.run_id)
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                config.update({u.key: json.loads(u.value_json) for u in record.config.update})
    return rows, config, ids


def wandb_series(rows: list[dict[str, Any]], key: str) -> dict[int, Any]:
    return {row["step"]: row[key] for row in rows if key in row}


def mlflow_client(run_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient((run_dir / "mlruns").resolve().as_uri())


def mlflow_series(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


# ---- each tracker ------------------------------------------------------------------------------------

LOSS = {step: 1.0 / step for step in STEPS}
ROLLOUT = {step: 0.5 * step for step in STEPS}


def test_tensorboard_event_files_read_back(tmp_path, plot):
    feed(TrackedRun(tmp_path, "tracked", CONFIG, 0), "tensorboard", plot)
    scalars, images = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == pytest.approx(LOSS)  # float32 in the event file
    assert scalars["train/phases/rollout"] == pytest.approx(ROLLOUT)
    assert scalars["train/probed"] == {s: float(s % 2 == 0) for s in STEPS}
    assert scalars["eval/avg_at_1"] == {3: EVAL["avg_at_k"]}
    assert scalars["eval/per_type/pick"] == {3: EVAL["per_type"]["pick"]}
    assert not [t for t in scalars if "per_task" in t or "turn_kl_profile" in t or "h_eff" in t or t.endswith("/mode")]
    assert images == ["frontier"]

    # resumed from the checkpoint of step 2: step 3 trains again, and its new record replaces the old one
    resumed = TRACKERS.get("tensorboard")(TrackedRun(tmp_path, "tracked", CONFIG, 2))
    resumed.log_record({**train_record(3), "loss": 9.0}, 3)
    resumed.close()
    assert tensorboard_scalars(tmp_path / "tensorboard")[0]["train/loss"] == pytest.approx({1: 1.0, 2: 0.5, 3: 9.0})


def test_wandb_without_credentials_writes_an_offline_run_that_resumes(tmp_path, plot, offline_wandb):
    assert wandb_mode() == "offline"
    run = TrackedRun(tmp_path, "tracked", CONFIG, 0)
    feed(run, "wandb", plot)
    run_id = saved_id(tmp_path, "wandb")
    rows, config, ids = wandb_history(tmp_path)
    assert ids == [run_id]
    assert wandb_series(rows, "train/loss") == pytest.approx(LOSS)
    assert wandb_series(rows, "train/phases/rollout") == pytest.approx(ROLLOUT)
    assert wandb_series(rows, "eval/avg_at_1") == {3: EVAL["avg_at_k"]}
    assert wandb_series(rows, "frontier/_type") == {3: "image-file"}
    assert config["trainer"] == CONFIG["trainer"] and config["name"] == CONFIG["name"]

    resumed = TRACKERS.get("wandb")(TrackedRun(tmp_path, "tracked", CONFIG, 3))
    resumed.log_record(train_record(4), 4)
    resumed.close()
    rows, _, ids = wandb_history(tmp_path, runs=2)
    assert ids == [run_id, run_id]  # the same run, continued
    assert wandb_series(rows, "train/loss") == pytest.approx({**LOSS, 4: 0.25})


def test_wandb_mode_follows_the_env_the_key_and_the_host(monkeypatch, offline_wandb, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert wandb_mode() == "offline"  # a host that answers, but no key
        (tmp_path / "home" / ".netrc").write_text("machine 127.0.0.1 login user password k3y\n")
        (tmp_path / "home" / ".netrc").chmod(0o600)
        assert wandb_mode() == "online"
        free = server.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free}")  # closed now: nothing listens
    assert wandb_mode() == "offline"


def test_mlflow_local_store_reads_back_and_resumes_the_same_run(tmp_path, plot, local_mlflow):
    feed(TrackedRun(tmp_path, "tracked", CONFIG, 0), "mlflow", plot)
    run_id = saved_id(tmp_path, "mlflow")
    client = mlflow_client(tmp_path)
    assert mlflow_series(client, run_id, "train/loss") == LOSS
    assert mlflow_series(client, run_id, "train/phases/rollout") == ROLLOUT
    assert mlflow_series(client, run_id, "eval/avg_at_1") == {3: EVAL["avg_at_k"]}
    assert mlflow_series(client, run_id, "train/teacher_replicas/tiny/http_/10.0.0.1_8000/requests") == \
        {s: 2.0 * s for s in STEPS}
    run = client.get_run(run_id)
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "turnopd"
    params = run.data.params
    assert params["trainer.lr"] == str(CONFIG["trainer"]["lr"]) and params["seed"] == str(CONFIG["seed"])
    assert params["trainer.betas"] == str(CONFIG["trainer"]["betas"]) and params["env.options"] == "{}"
    assert [a.path for a in client.list_artifacts(run_id)] == ["frontier.png"]

    resumed = TRACKERS.get("mlflow")(TrackedRun(tmp_path, "tracked", CONFIG, 3))
    assert client.get_run(run_id).info.status == "RUNNING"
    resumed.log_record(train_record(4), 4)
    resumed.close()
    assert saved_id(tmp_path, "mlflow") == run_id
    assert mlflow_series(client, run_id, "train/loss") == {**LOSS, 4: 0.25}
    assert len(client.search_runs([run.info.experiment_id])) == 1


SETTINGS = TrackerSettings(project="sweeps", entity="lab", group="abl", tags=["turnopd", "alfworld"],
                           run_name="abl-turnopd-s0")


def test_the_tracker_settings_reach_the_wandb_offline_run(tmp_path, plot, offline_wandb):
    feed(TrackedRun(tmp_path, SETTINGS.run_name, CONFIG, 0, SETTINGS), "wandb", plot)
    [log] = finished_wandb_logs(tmp_path, 1)
    [run] = [r.run for r in log if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.entity, run.run_group, list(run.tags), run.display_name) == (
        "sweeps", "lab", "abl", ["turnopd", "alfworld"], "abl-turnopd-s0")


def test_the_tracker_settings_reach_mlflow(tmp_path, plot, local_mlflow):
    feed(TrackedRun(tmp_path, SETTINGS.run_name, CONFIG, 0, SETTINGS), "mlflow", plot)
    client = mlflow_client(tmp_path)
    run = client.get_run(saved_id(tmp_path, "mlflow"))
    assert client.get_experiment(run.info.experiment_id).name == "sweeps"
    assert run.info.run_name == "abl-turnopd-s0"
    assert {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")} == {
        "turnopd": "", "alfworld": "", "group": "abl"}


# ---- the recipe key ----------------------------------------------------------------------------------


def test_the_recipe_names_known_installed_trackers_once(tmp_path, monkeypatch):
    from turnopd.orchestration.recipe import load_recipe

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: t\nstudent: {path: x}\nteachers: {alfworld: t.yaml}\n")
    assert load_recipe(recipe).tracking == ["tensorboard"]
    assert load_recipe(recipe, ["tracking=[]"]).tracking == []
    assert load_recipe(recipe, ["tracking=[tensorboard,wandb,mlflow]"]).tracking == ["tensorboard", "wandb", "mlflow"]
    with pytest.raises(RecipeError, match=r"recipe key 'tracking': 'neptune' is not allowed; "
                                          r"allowed: mlflow, tensorboard, wandb"):
        load_recipe(recipe, ["tracking=[tensorboard,neptune]"])
    with pytest.raises(RecipeError, match=r"recipe key 'tracking': 'wandb' named twice"):
        load_recipe(recipe, ["tracking=[wandb,mlflow,wandb]"])

    hide_package(monkeypatch, "mlflow")
    with pytest.raises(RecipeError, match=r"recipe key 'tracking': 'mlflow' needs the mlflow package, which is "
                                          r"not installed: pip install 'turnopd\[tracking\]'"):
        load_recipe(recipe, ["tracking=[mlflow]"])


# ---- a distillation ----------------------------------------------------------------------------------

RECIPE = """
name: tracked
depth: {{warmup_steps: 1, probe_every: 2, num_probes: 2, min_successes: 1}}
trainer: {{steps: 2, episodes_per_step: 2, lr: 1.0e-3}}
eval: {{max_tasks: 1}}
"""


@pytest.mark.slow  # 100 s on 2 cores
def test_a_distillation_logs_each_step_to_every_tracker(tmp_path, tiny_model_dir, offline_wandb, local_mlflow):
    from turnopd.orchestration.distill import run_distillation
    from turnopd.orchestration.recipe import load_recipe

    models = loop_models(tmp_path / "loop", tiny_model_dir, RECIPE)
    cfg = load_recipe(models / "recipe.yaml", ["tracking=[tensorboard,wandb,mlflow]", "tracker.group=abl",
                                               "tracker.run_name=named"])
    run_dir = Path(run_distillation(cfg)["run_dir"])
    records = read_metrics(run_dir / "metrics.jsonl")
    loss = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert sorted(loss) == [1, 2]

    scalars, images = tensorboard_scalars(run_dir / "tensorboard")
    assert scalars["train/loss"] == pytest.approx(loss, rel=1e-6)
    assert scalars["eval/avg_at_1"][2] == pytest.approx(final["avg_at_k"])
    assert images == ["frontier"]

    rows, config, _ = wandb_history(run_dir)
    assert wandb_series(rows, "train/loss") == loss
    assert wandb_series(rows, "eval/avg_at_1")[2] == final["avg_at_k"]
    assert wandb_series(rows, "frontier/_type") == {2: "image-file"}
    assert config["trainer"]["steps"] == cfg.trainer.steps and config["name"] == cfg.name
    [wandb_run] = [r.run for r in finished_wandb_logs(run_dir, 1)[0] if r.WhichOneof("record_type") == "run"]
    assert (wandb_run.run_group, wandb_run.display_name) == ("abl", "named")

    client, run_id = mlflow_client(run_dir), saved_id(run_dir, "mlflow")
    assert mlflow_series(client, run_id, "train/loss") == loss
    assert client.get_run(run_id).data.params["trainer.episodes_per_step"] == str(cfg.trainer.episodes_per_step)
    assert (client.get_run(run_id).info.run_name, client.get_run(run_id).data.tags["group"]) == ("named", "abl")
    assert [a.path for a in client.list_artifacts(run_id)] == ["frontier.png"]
    assert (run_dir / "frontier.png").stat().st_size > 10_000
