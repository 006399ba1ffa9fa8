"""Experiment trackers (logging.trackers): TensorBoard, Weights & Biases, MLflow, one small class each behind
one interface. Each receives every row written to metrics.jsonl, the resolved config and the run name; each
package is imported only when its tracker is asked for. Rank 0 alone opens them.

A tracked run's id is kept in <output_dir>/trackers.json, so a resumed training run continues the same W&B
run (resume="allow" with its id) and the same MLflow run (its run_id) instead of starting another.

The folder each tracker writes into (tensorboard/, wandb/, mlruns/) is one the run made itself: a symbolic
link, FIFO or file at that name is refused with one line (UnsafePath), never followed, since the tracker's
package opens its files itself. A URI is recorded and shown without its user, password or query string
(safe_io.urls.display); an MLflow server's credentials reach MLflow through its own environment variables.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import yaml

from config import Config, ConfigError
from config.loading import parse_override
from safe_io import nofollow
from safe_io.nofollow import replace_file
from safe_io.urls import display, is_url, scrub, without_credentials

log = logging.getLogger("train")

# tracker -> (the module it imports, the package that provides it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny (or mlflow)")}
IDS_FILE = "trackers.json"
MLRUNS = "mlruns"  # the default MLflow file store, in the output directory


def tracker_problems(names: Iterable[str]) -> list[str]:
    """One line per tracker whose package is not installed (checked before the process group starts)."""
    problems = []
    for name in names:
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            problems.append(f"logging.trackers names {name}, but the {module} package is not installed: "
                            f"pip install {package.split(' ')[0]} (or remove {name} from logging.trackers)")
    return problems


def tracker_key(key: str) -> str:
    """A metrics.jsonl key as trackers show it: val_loss -> val/loss, a key with a '/' as it is (an
    evaluation's 'eval/<task>_acc'), anything else under train/."""
    if key == "val_loss":
        return "val/loss"
    return key if "/" in key else f"train/{key}"


def scalars(row: dict) -> dict[str, float]:
    """The finite numbers of a metrics row, under their trackers' names (the step itself excluded)."""
    return {tracker_key(k): float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Tracker(Protocol):
    name: str

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Scalars (already named by tracker_key) at a training step."""

    def close(self) -> None: ...


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1e-3}} -> {'train.lr': 1e-3}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, out_dir: Path, *, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        # The event files go into the run's own folder, never through a link to another one.
        self.writer = SummaryWriter(str(nofollow.make_dir(out_dir / "tensorboard")))
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", f"run {run_name}\n\n```yaml\n{text}```".replace("\n", "  \n"))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


@contextmanager
def command_line_without_secrets() -> Iterator[None]:
    """sys.argv with every URL as display() shows it, for the duration: W&B records the command line of the run
    it starts (its metadata's "args"), and an override such as --logging.mlflow_tracking_uri=... may hold a
    password."""
    saved = sys.argv
    sys.argv = [redacted_argument(arg) for arg in saved]
    try:
        yield
    finally:
        sys.argv = saved


def redacted_argument(arg: str) -> str:
    """A command-line argument as it may be printed or recorded: every URL in it without user, password or query
    string. An override's value is read as the config loader reads it (`--data.files=["URL", "URL"]` is a list of
    two URLs, whatever characters their passwords hold); other text has the URLs that safe_io.urls.scrub finds."""
    if is_url(arg):
        return display(arg)
    if arg.startswith("--") and "=" in arg:
        try:
            keys, value = parse_override(arg)
        except ConfigError:
            return scrub(arg)
        shown = without_credentials(value)
        if shown != value:
            return f"--{'.'.join(keys)}=" + (shown if isinstance(shown, str) else json.dumps(shown, default=str))
    return scrub(arg)


class WandbTracker:
    name = "wandb"

    def __init__(self, out_dir: Path, *, cfg: Config, config: dict, run_id: str | None):
        import wandb

        lg = cfg.logging
        nofollow.make_dir(out_dir / "wandb")  # W&B writes <dir>/wandb/: a real folder of the run, never a link
        # resume="allow": the run of run_id continues if W&B knows it, and starts under that id otherwise.
        with command_line_without_secrets():
            self.run = wandb.init(project=lg.wandb_project, entity=lg.wandb_entity or None, name=cfg.run.name,
                                  id=run_id, resume="allow", dir=str(out_dir),
                                  mode=lg.wandb_mode or None,
                                  config=config, allow_val_change=True)
        self.run_id = self.run.id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    name = "mlflow"

    def __init__(self, uri: str, *, cfg: Config, config: dict, run_id: str | None):
        """uri: the tracking URI as given (credentials and all); `self.uri` is the one to show and record."""
        lg = cfg.logging
        if uri.startswith("file:") or "://" not in uri:
            # MLflow refuses its file store unless told otherwise; it is the one store that needs nothing but
            # mlflow-skinny, and the default one is the run's own folder, so this opt-out is ours to give.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self.client, self.uri = Metric, MlflowClient(tracking_uri=mlflow_client_uri(uri)), display(uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(lg.mlflow_experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(lg.mlflow_experiment))
            run_id = self.client.create_run(experiment_id, run_name=cfg.run.name).info.run_id
            known: dict[str, str] = {}
        else:
            self.client.update_run(run_id, status="RUNNING")
            known = self.client.get_run(run_id).data.params
        self.run_id = run_id
        # A parameter cannot change once logged: a resume that changed the config logs only the new keys
        # (the whole resolved config is the config.yaml artifact, rewritten each time).
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items() if k not in known]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(run_id, params=params[first:first + 100])
        self.client.log_dict(run_id, config, "config.yaml")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_uri(cfg: Config) -> str:
    """logging.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else a file store in <output_dir>/mlruns (the
    output directory made absolute, mlruns itself not resolved: a link there is refused, never followed)."""
    return (cfg.logging.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
            or (cfg.output_dir.resolve() / MLRUNS).as_uri())


def mlflow_client_uri(uri: str) -> str:
    """The URI MLflow is given. An http(s) server's has no user, password or query string (a query has no place
    in a REST base URL): the user and password go to MLflow as MLFLOW_TRACKING_USERNAME and
    MLFLOW_TRACKING_PASSWORD (set ones win, as they did over the URL's), so no message or link MLflow prints
    holds them. Any other store's URI (a database URL, whose password is its login) is given as it is."""
    parts = urlsplit(uri)
    if parts.scheme.lower() not in ("http", "https"):
        return uri
    if parts.username:
        os.environ.setdefault("MLFLOW_TRACKING_USERNAME", unquote(parts.username))
    if parts.password is not None:
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", unquote(parts.password))
    return display(uri)


def read_ids(path: Path) -> dict:
    """The tracked runs' ids kept in trackers.json ({} when there is none); one line naming it if unreadable."""
    if not os.path.lexists(path):
        return {}
    try:
        ids = json.loads(nofollow.read_small(path, limit=1 << 20))
    except nofollow.UnsafePath:
        raise
    except (OSError, ValueError, RecursionError) as err:
        raise nofollow.UnsafePath(path, f"unreadable ({type(err).__name__}: {err}); fix or remove it") from None
    if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
        raise nofollow.UnsafePath(path, "not a record of tracked run ids; fix or remove it")
    return ids


def open_trackers(cfg: Config, *, resumed: bool) -> list[Tracker]:
    """The trackers of logging.trackers, on rank 0. A resumed run reuses the run ids kept in trackers.json;
    a fresh one starts new tracked runs and records their ids there."""
    out_dir = cfg.output_dir
    ids_path = out_dir / IDS_FILE
    ids = read_ids(ids_path) if resumed else {}
    config = cfg.to_dict()
    trackers: list[Tracker] = []
    for name in cfg.logging.trackers:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(out_dir, run_name=cfg.run.name, config=config))
        elif name == "wandb":
            tracker = WandbTracker(out_dir, cfg=cfg, config=config, run_id=ids.get("wandb"))
            ids["wandb"] = tracker.run_id
            trackers.append(tracker)
        elif name == "mlflow":
            uri = mlflow_uri(cfg)
            if uri == (out_dir.resolve() / MLRUNS).as_uri():  # the default store: the run's own folder
                nofollow.make_dir(out_dir / MLRUNS)
            # A run id means nothing in another store (the URIs compared as recorded: without credentials).
            same_store = display(ids.get("mlflow_tracking_uri", "")) == display(uri)
            mlflow = MLflowTracker(uri, cfg=cfg, config=config, run_id=ids.get("mlflow") if same_store else None)
            ids["mlflow"], ids["mlflow_tracking_uri"] = mlflow.run_id, mlflow.uri
            trackers.append(mlflow)
        if name != "tensorboard":
            log.info("%s: tracking run %s", name, ids[name])
    if ids:
        replace_file(ids_path, (json.dumps(ids, indent=1) + "\n").encode())
    return trackers
