"""Experiment trackers beside metrics.jsonl (recipe key `tracking`, any of the names of TRACKERS).

metrics.jsonl (turnopd.core.metrics) stays the run's record, written first and fsynced; a tracker
mirrors its records for a dashboard, on rank 0, flushing each one as its library allows:
- every numeric field of a train record, nested ones flattened with "/" (phases.rollout ->
  train/phases/rollout), under train/; an evaluation's under its kind (eval/avg_at_1,
  teacher_eval/per_type/<task type>, ...; its per-task scores stay in metrics.jsonl);
- the run's accuracy-vs-training-time plot (frontier.png) at the end.

Where a run is filed is the recipe's `tracker` section (TrackerSettings: project, entity, group, tags,
run_name), each tracker taking what it has a place for:
- tensorboard: event files in <run_dir>/tensorboard (a resumed run hides the steps it trains again);
  it has no project or tags (point `tensorboard --logdir` at the runs to compare).
- wandb: the project (default "turnopd"), entity, group, tags and run name (default the recipe's
  name), the resolved recipe as its config, files in <run_dir>/wandb. Online
  when $WANDB_MODE says so, or when it is unset and an API key ($WANDB_API_KEY, or a netrc entry for
  the W&B host) and the host are there; else offline (`wandb sync <run_dir>/wandb/offline-run-*`
  uploads it later). Steps are on the "step" metric, so evaluations share their step's point.
- mlflow: the project as the experiment, the run name, the tags as tags with an empty value and the
  group as the tag `group` (MLflow has no entity), the flattened recipe as params, in $MLFLOW_TRACKING_URI or else a
  local file store <run_dir>/mlruns (`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri
  <run_dir>/mlruns`).
A resumed run (--resume) continues the same wandb and mlflow runs: their ids are in
<run_dir>/tracking.json. The libraries are imported when a tracker opens; a recipe naming one
whose package is missing is refused when checked (turnopd.config).
"""

from __future__ import annotations

import json
import netrc
import os
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol
from urllib.parse import urlparse

from turnopd.core.registry import Registry

TRACKING_EXTRA = "turnopd[tracking]"  # the pip extra that installs the trackers' packages
IDS_FILE = "tracking.json"  # in the run folder: tracker -> the id of its run, for --resume
SKIPPED_EVAL_FIELDS = ("per_task",)  # one series per held-out task: metrics.jsonl keeps them


@dataclass
class TrackerSettings:
    """The recipe's `tracker` section: where the trackers file the run (what each one uses: the module
    docstring). Sweeps organize their runs by group and tags (`turnopd sweep` sets them)."""

    project: str = "turnopd"
    entity: str | None = None  # a wandb team or user; None: the API key's default
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    run_name: str | None = None  # None: the recipe's name


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker is opened with."""

    run_dir: Path
    name: str  # the run's name in the tracker
    config: dict[str, Any]  # the resolved recipe, plain containers
    start_step: int  # 0, or the checkpoint step a resumed run continues from
    settings: TrackerSettings = field(default_factory=TrackerSettings)


class Tracker(Protocol):
    """One experiment tracker of a run, opened as cls(TrackedRun)."""

    package: ClassVar[str]  # the module it imports (a recipe naming it checks that it is installed)
    output: ClassVar[str]  # where it writes, for the run's summary line

    def log_record(self, record: dict[str, Any], step: int) -> None:
        """A train record, as written to metrics.jsonl."""

    def log_eval(self, kind: str, record: dict[str, Any], step: int) -> None:
        """An evaluation record (kind: eval, final_eval, teacher_eval)."""

    def log_image(self, name: str, path: Path, step: int) -> None: ...

    def close(self) -> None: ...


TRACKERS: Registry[type[Tracker]] = Registry("tracker")


def scalars(record: dict[str, Any], prefix: str, skip: tuple[str, ...] = ()) -> dict[str, float]:
    """The numeric fields of a record (booleans as 0/1), nested dicts flattened with "/", each key
    under `prefix`; lists, strings and None are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in skip:
            continue
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (bool, int, float)):
            out[f"{prefix}{key}"] = float(value)
    return out


def train_scalars(record: dict[str, Any]) -> dict[str, float]:
    return scalars(record, "train/", skip=("kind", "step"))


def eval_scalars(kind: str, record: dict[str, Any]) -> dict[str, float]:
    values = scalars(record, f"{kind}/", skip=("kind", "step", *SKIPPED_EVAL_FIELDS))
    if "avg_at_k" in record and "k" in record:  # the curve's name says which k: eval/avg_at_1
        values[f"{kind}/avg_at_{record['k']}"] = values.pop(f"{kind}/avg_at_k")
    return values


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested recipe as {"trainer.lr": 1e-06, ...}; an empty mapping is a value of its own."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def saved_id(run_dir: Path, tracker: str) -> str | None:
    path = run_dir / IDS_FILE
    return json.loads(path.read_text()).get(tracker) if path.is_file() else None


def save_id(run_dir: Path, tracker: str, run_id: str) -> None:
    path = run_dir / IDS_FILE
    ids = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**ids, tracker: run_id}, indent=1) + "\n")


class _ScalarTracker:
    """log_record and log_eval as one call of log_scalars per record."""

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_record(self, record: dict[str, Any], step: int) -> None:
        self.log_scalars(train_scalars(record), step)

    def log_eval(self, kind: str, record: dict[str, Any], step: int) -> None:
        self.log_scalars(eval_scalars(kind, record), step)


@TRACKERS.register("tensorboard")
class TensorBoardTracker(_ScalarTracker):
    package = "tensorboard"
    output = "tensorboard/"

    def __init__(self, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run trains the steps after its checkpoint again: TensorBoard hides the old ones
        self.writer = SummaryWriter(str(run.run_dir / "tensorboard"),
                                    purge_step=run.start_step + 1 if run.start_step else None)

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_image(self, name: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            self.writer.add_image(name, np.asarray(image.convert("RGB")), step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to host:port opens within timeout_s (name lookup included)."""
    done: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            done.append(True)
        except OSError:
            done.append(False)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(done and done[0])


def _netrc_has(host: str) -> bool:
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str:
    """$WANDB_MODE when set; else online when there is an API key and the W&B host answers within a
    second, else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    has_key = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has(host)
    return "online" if has_key and _reachable(host, port) else "offline"


@TRACKERS.register("wandb")
class WandbTracker(_ScalarTracker):
    package = "wandb"
    output = "wandb/"

    def __init__(self, run: TrackedRun):
        import wandb

        run_id = saved_id(run.run_dir, "wandb")
        if run_id is None:
            run_id = secrets.token_hex(6)
            save_id(run.run_dir, "wandb", run_id)
        self.wandb = wandb
        settings = run.settings
        self.run = wandb.init(project=settings.project, entity=settings.entity, group=settings.group,
                              tags=list(settings.tags) or None, name=run.name, dir=str(run.run_dir),
                              config=run.config, id=run_id, resume="allow", mode=wandb_mode())
        # on their own step axis: an evaluation logs to the step its train record did, and a resumed
        # run to the steps after its checkpoint, which wandb's monotonic _step would drop
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **values})

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.run.log({"step": step, name: self.wandb.Image(str(path))})

    def close(self) -> None:
        self.run.finish()


MLFLOW_PARAM_CHARS = 500  # longest param value every MLflow server takes
MLFLOW_BATCH = {"params": 100, "metrics": 1000}  # most of each per log_batch call


def _mlflow_key(key: str) -> str:
    """An MLflow name: letters, digits, _ - . and spaces between single slashes, no "." or ".." part
    (a teacher replica's URL in a key has more)."""
    parts = [re.sub(r"[^\w\-. ]", "_", part) for part in key.split("/") if part]
    return "/".join("_" if not part.strip(".") else part for part in parts)


@TRACKERS.register("mlflow")
class MlflowTracker(_ScalarTracker):
    package = "mlflow"
    output = "mlruns/ (or $MLFLOW_TRACKING_URI)"

    def __init__(self, run: TrackedRun):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run.run_dir / "mlruns").resolve().as_uri()
        if urlparse(uri).scheme in ("", "file"):
            # mlflow-skinny has no database store, and MLflow 3 opens a file store only when asked to
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        self.run_id = saved_id(run.run_dir, "mlflow")
        try:
            known = self.client.get_run(self.run_id).data.params if self.run_id else None
        except MlflowException:  # another store, or the run was deleted: start a new one
            known = None
        if known is None:
            self.run_id = self._create_run(run)
            save_id(run.run_dir, "mlflow", self.run_id)
            known = {}
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        # params are written once: a resumed run (same recipe) adds only what is missing
        params = [Param(_mlflow_key(k), str(v)[:MLFLOW_PARAM_CHARS]) for k, v in flat_config(run.config).items()
                  if _mlflow_key(k) not in known]
        for i in range(0, len(params), MLFLOW_BATCH["params"]):
            self.client.log_batch(self.run_id, params=params[i:i + MLFLOW_BATCH["params"]])

    def _create_run(self, run: TrackedRun) -> str:
        """A new run in the experiment named by the settings' project, with their tags and group."""
        project = run.settings.project
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        tags = {tag: "" for tag in run.settings.tags}
        if run.settings.group:
            tags["group"] = run.settings.group
        return self.client.create_run(experiment_id, run_name=run.name, tags=tags).info.run_id

    def log_scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), MLFLOW_BATCH["metrics"]):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MLFLOW_BATCH["metrics"]])

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
