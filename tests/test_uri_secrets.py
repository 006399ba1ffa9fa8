"""The user, password and query string of a URI (logging.mlflow_tracking_uri, MLFLOW_TRACKING_URI, data.files)
never reach anything the project writes or prints: config.yaml, trackers.json, the TensorBoard events, the W&B
run (its config and its record of the command line), MLflow's parameters and the console. MLflow itself still
authenticates with them: a small MLflow REST server in this process checks what it receives.

The URIs are generated (seeded): users and passwords of every character a URI's user part may hold, some
percent-encoded, and query strings with tokens.
"""
from __future__ import annotations

import base64
import json
import random
import string
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

from config import Config, save_config
from fsdp_utils.observability.trackers import command_line_without_secrets, open_trackers, redacted_argument

# What RFC 3986 allows in a URI's user and password unencoded (unreserved and sub-delimiters), and characters
# that must be percent-encoded there.
USERINFO = string.ascii_letters + string.digits + "-._~!$&'()*+,;="
ENCODED = "@:/?#[] %"


def secret(rng: random.Random, alphabet: str, n: int = 12) -> str:
    # A letter first: a distinctive string that occurs nowhere else in what is checked.
    return rng.choice(string.ascii_letters) + "".join(rng.choice(alphabet) for _ in range(n - 1))


def secret_uri(rng: random.Random, *, scheme: str = "http",
               host: str = "mlflow.example.com:5000") -> tuple[str, list[str]]:
    """(a URI with a user, a password and a query string, the secrets it holds as they appear in it and
    decoded)."""
    user = secret(rng, USERINFO)
    password = secret(rng, USERINFO + ENCODED)
    token = secret(rng, string.ascii_letters + string.digits)
    encoded = quote(password, safe=USERINFO)
    uri = f"{scheme}://{user}:{encoded}@{host}/prefix?token={token}&x=1"
    return uri, [user, encoded, password, token]


def uris(n: int, seed: int = 0, **kwargs) -> list[tuple[str, list[str]]]:
    rng = random.Random(seed)
    return [secret_uri(rng, **kwargs) for _ in range(n)]


def leaked(text: str, secrets: list[str]) -> list[str]:
    return [s for s in secrets if s in text]


@pytest.mark.parametrize(("uri", "secrets"), uris(40, scheme="https") + uris(10, seed=1, scheme="postgresql"))
def test_config_yaml_and_a_command_line_hold_no_credentials(tmp_path, uri, secrets):
    cfg = Config()
    cfg.logging.mlflow_tracking_uri = uri
    cfg.data.files = [uri.replace("/prefix", "/corpus.jsonl")]
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert leaked(text, secrets) == []
    host = urlsplit(uri).hostname
    assert f"mlflow_tracking_uri: {urlsplit(uri).scheme}://{host}:5000/prefix" in text
    # A list of URLs is quoted on the command line, as YAML needs for a '?' inside a list.
    for arg in (f"--logging.mlflow_tracking_uri={uri}", uri, f'--data.files=["{uri}", "{uri}"]'):
        shown = redacted_argument(arg)
        assert leaked(shown, secrets) == [] and host in shown, shown


def test_arguments_without_urls_are_left_as_they_are():
    for arg in ("--train.lr=3e-4", "--run.name=a:b@c", "config/train.yaml", "--data.files=[a.jsonl, b.jsonl]"):
        assert redacted_argument(arg) == arg


def test_wandb_records_the_command_line_without_credentials(monkeypatch):
    uri, secrets = secret_uri(random.Random(2))
    monkeypatch.setattr(sys, "argv", ["train_fsdp.py", "config.yaml", f"--logging.mlflow_tracking_uri={uri}"])
    with command_line_without_secrets():
        assert leaked(" ".join(sys.argv), secrets) == [] and sys.argv[1] == "config.yaml"
    assert sys.argv[2].endswith(uri)  # the process's own command line is given back as it was


# ---- an MLflow server -----------------------------------------------------------------------------------------

class MlflowServer(BaseHTTPRequestHandler):
    """The REST calls MlflowClient makes to start, log to and end a run; each request's path and credentials
    (HTTP basic authentication, decoded) are recorded."""

    requests: list[tuple[str, str | None]] = []
    artifact_uri = ""

    def log_message(self, *args) -> None:
        pass

    def _run(self, status: str = "RUNNING") -> dict:
        return {"info": {"run_id": "run1", "run_uuid": "run1", "experiment_id": "1", "run_name": "tracked",
                         "status": status, "start_time": 0, "artifact_uri": self.artifact_uri,
                         "lifecycle_stage": "active", "user_id": "u"}, "data": {}}

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization")
        credentials = base64.b64decode(auth.removeprefix("Basic ")).decode() if auth else None
        self.requests.append((self.path, credentials))
        endpoint = urlsplit(self.path).path.removeprefix("/prefix/api/2.0/mlflow/")
        code, body = {"experiments/get-by-name": (404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "none"}),
                      "experiments/create": (200, {"experiment_id": "1"}),
                      "runs/create": (200, {"run": self._run()}), "runs/get": (200, {"run": self._run()}),
                      "runs/update": (200, {"run_info": self._run("FINISHED")["info"]}),
                      "runs/log-batch": (200, {})}.get(endpoint, (404, {"error_code": "ENDPOINT_NOT_FOUND",
                                                                        "message": self.path}))
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@contextmanager
def mlflow_server(artifacts: Path) -> Iterator[str]:
    """host:port of a server answering as MLflow's tracking server; its artifacts go to a local folder."""
    MlflowServer.requests, MlflowServer.artifact_uri = [], artifacts.as_uri()
    server = ThreadingHTTPServer(("127.0.0.1", 0), MlflowServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def tracked_files(out: Path) -> str:
    """Everything the run wrote into its output directory, as text."""
    return "".join(p.read_bytes().decode(errors="replace") for p in sorted(out.rglob("*")) if p.is_file())


@pytest.mark.parametrize("given_by", ["config", "environment"])
@pytest.mark.parametrize(("seed", "trackers"), [(3, ["tensorboard", "mlflow"]), (4, ["mlflow"]),
                                                (5, ["tensorboard", "wandb", "mlflow"])])
def test_an_mlflow_password_reaches_mlflow_and_nothing_else(tmp_path, monkeypatch, capsys, caplog, seed, trackers,
                                                          given_by):
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)  # and what the tracker sets is removed after the test
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    out = tmp_path / "run"
    out.mkdir()
    with mlflow_server(tmp_path / "artifacts") as host:
        uri, secrets = secret_uri(random.Random(seed), host=host)
        cfg = Config()
        cfg.run.output_dir, cfg.run.name = str(out), "tracked"
        cfg.logging.trackers, cfg.logging.wandb_mode = trackers, "offline"
        if given_by == "config":
            cfg.logging.mlflow_tracking_uri = uri
        else:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setattr(sys, "argv", ["train_fsdp.py", "config.yaml", f"--logging.mlflow_tracking_uri={uri}"])
        save_config(cfg, out / "config.yaml")
        opened = open_trackers(cfg, resumed=False)
        for tracker in opened:
            tracker.log_metrics({"train/loss": 1.0}, 1)
            tracker.close()
    user, _, password, _ = secrets
    # Every request MLflow made carried the user and password (decoded); none went to another path.
    assert MlflowServer.requests and {c for _, c in MlflowServer.requests} == {f"{user}:{password}"}
    assert all(path.startswith("/prefix/api/2.0/mlflow/") for path, _ in MlflowServer.requests)
    written = tracked_files(out) + tracked_files(tmp_path / "artifacts")
    printed = capsys.readouterr()
    assert leaked(written, secrets) == [] and leaked(printed.out + printed.err + caplog.text, secrets) == []
    assert json.loads((out / "trackers.json").read_text())["mlflow_tracking_uri"] == f"http://{host}/prefix"
    assert f"View run tracked at: http://{host}/prefix/#/experiments/1/runs/run1" in printed.out
    if "wandb" in trackers:
        assert (f"--logging.mlflow_tracking_uri=http://{host}/prefix".encode()
                in next((out / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes())
