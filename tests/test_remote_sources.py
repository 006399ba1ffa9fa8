"""data.files as URLs (data/remote.py), read from real servers started here: an HTTP server that answers range
requests (and fails on request), and moto's S3 server, whose listings page every LIST_PAGE keys."""
from __future__ import annotations

import gzip
import json
import logging
import multiprocessing
import re
import shutil
import sys
import threading
import tracemalloc
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from data import DataError, PrepareSettings, prepare_data, remote
from safe_io import urls
from scripts import prepare_data as prepare_script
from tests.test_data import VOCAB_SIZE, make_documents, prep
from tests.test_prepare import jsonl_lines, stopped_after, store_files

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
pytest.importorskip("aiohttp")

BUCKET = "corpus-bucket"
LIST_PAGE = 10  # keys per listing page of the S3 server: the corpus below takes several pages
NUM_FILES = 40
FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "txt")


def write_part(path: Path, documents: list[str]) -> None:
    """documents in the format path's suffix names (a .txt file is one document: the first)."""
    if path.name.endswith(".parquet"):
        pq.write_table(pa.table({"text": documents}), path, row_group_size=4)
    elif path.name.endswith(".txt"):
        path.write_text(documents[0])
    else:
        data = jsonl_lines(documents).encode()
        compress = {".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}.get(path.suffix)
        path.write_bytes(compress(data) if compress else data)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """NUM_FILES small files of every format, named so that their sorted order is the same as URLs."""
    folder = tmp_path_factory.mktemp("remote") / "corpus"
    folder.mkdir()
    documents = make_documents(NUM_FILES * 6, seed=11)
    for i in range(NUM_FILES):
        write_part(folder / f"part-{i:04d}.{FORMATS[i % len(FORMATS)]}", documents[i * 6 : i * 6 + 6])
    return folder


# ---------------------------------------------------------------- the HTTP server


class RangeHandler(BaseHTTPRequestHandler):
    """Serves the server's folder with HEAD and GET, GET with a byte range too. A GET of a name in
    server.faults takes the next fault of its list first: a status to answer with, "drop" (the
    connection closes without an answer), "replace" (the file is rewritten, then the connection drops) or "ok"
    (none this time); once a list is empty the file is served."""

    server: FileServer

    def log_message(self, format, *args) -> None:  # noqa: A002 - the standard library's signature
        pass

    def do_HEAD(self) -> None:  # noqa: N802 - the standard library's name
        self._serve(body=False)

    def do_GET(self) -> None:  # noqa: N802
        with self.server.lock:
            faults = self.server.faults.get(urlsplit(self.path).path.lstrip("/"), [])
            fault = faults.pop(0) if faults else None
        if fault in ("drop", "replace"):
            if fault == "replace":  # the object is rewritten (a new ETag) as the connection drops
                path = self.server.root / unquote(urlsplit(self.path).path).lstrip("/")
                path.write_bytes(path.read_bytes() + b"\n")
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fault not in (None, "ok"):
            self.send_error(int(fault))
            return
        self._serve(body=True)

    def _serve(self, *, body: bool) -> None:
        name = unquote(urlsplit(self.path).path).lstrip("/")
        if name in self.server.forbidden:
            self.send_error(HTTPStatus.FORBIDDEN)
            return
        path = self.server.root / name
        if not path.is_file():
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        data = path.read_bytes()
        start, end = 0, len(data)
        if body and (match := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))):
            start, end = int(match.group(1)), min(int(match.group(2) or len(data) - 1) + 1, len(data))
            self.send_response(HTTPStatus.PARTIAL_CONTENT)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        else:
            self.send_response(HTTPStatus.OK)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", f'"{path.stat().st_mtime_ns}-{len(data)}"')
        self.end_headers()
        if body:
            self.wfile.write(data[start:end])


class FileServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path):
        super().__init__(("127.0.0.1", 0), RangeHandler)
        self.root = root
        self.faults: dict[str, list] = {}
        self.forbidden: set[str] = set()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def http_server(corpus):
    server = FileServer(corpus.parent)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


# ---------------------------------------------------------------- the S3 server


@pytest.fixture(scope="module")
def s3_server(corpus):
    """moto's S3 server, with the corpus under s3://BUCKET/corpus/."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(corpus.iterdir()):
        client.put_object(Bucket=BUCKET, Key=f"corpus/{path.name}", Body=path.read_bytes())
    yield endpoint, client
    server.stop()


def aws_env(endpoint: str) -> dict[str, str]:
    """The variables botocore reads: this server, test keys, and no file or instance metadata of this machine."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
            "MOTO_S3_DEFAULT_MAX_KEYS": str(LIST_PAGE)}


@pytest.fixture
def s3(s3_server, monkeypatch):
    endpoint, client = s3_server
    for name, value in aws_env(endpoint).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(remote, "RETRY_DELAY_S", 0.01)
    return client


@pytest.fixture
def small_chunks(monkeypatch):
    """Work units of 4 KB: the corpus makes many of them, and several shards of 2,000 tokens."""
    monkeypatch.setattr("data.prepare.CHUNK_BYTES", 4096)


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(remote, "RETRIES", 2)
    monkeypatch.setattr(remote, "RETRY_DELAY_S", 0.01)


@pytest.fixture(scope="module")
def local_reference(corpus, tmp_path_factory):
    """The corpus prepared from the local folder, in work units of 4 KB (as small_chunks makes them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("data.prepare.CHUNK_BYTES", 4096)
        return store_files(prep(tmp_path_factory.mktemp("local"), [str(corpus)], shard_tokens=2000, num_workers=0))


def http_urls(server: FileServer, corpus: Path) -> list[str]:
    return [f"{server.url}/corpus/{path.name}" for path in sorted(corpus.iterdir())]


# ---------------------------------------------------------------- same shards from every source


@pytest.mark.slow  # starts worker processes
@pytest.mark.parametrize("num_workers", [1, 2])
def test_the_same_shards_from_local_http_and_s3(num_workers, corpus, local_reference, http_server, s3, small_chunks,
                                                tmp_path):
    from_http = prep(tmp_path / "http", http_urls(http_server, corpus), num_workers=num_workers, shard_tokens=2000)
    from_s3 = prep(tmp_path / "s3", [f"s3://{BUCKET}/corpus/*"], num_workers=num_workers, shard_tokens=2000)
    assert len(from_s3.train_files) > 3
    assert store_files(from_http) == local_reference
    assert store_files(from_s3) == local_reference


def test_a_listing_that_pages_is_read_to_its_end(corpus, s3):
    from data.readers import expand_inputs

    found = expand_inputs([f"s3://{BUCKET}/corpus/"])  # a folder: every file below it
    assert [f.name for f in found] == sorted(p.name for p in corpus.iterdir())
    assert len(found) == NUM_FILES > 3 * LIST_PAGE
    assert [str(f) for f in expand_inputs([f"s3://{BUCKET}/corpus/part-00[0-1]?.jsonl"])] == [
        f"s3://{BUCKET}/corpus/part-{i:04d}.jsonl" for i in range(0, 20, len(FORMATS))]


# ---------------------------------------------------------------- network errors


def test_transient_errors_are_retried(corpus, http_server, quick_retries, small_chunks, tmp_path, monkeypatch):
    # Each fault hits a read (a GET of a block of 256 bytes), not the listing (a HEAD), some past the first
    # block: the reader continues where it stopped.
    monkeypatch.setattr(remote, "BLOCK_BYTES", 256)
    monkeypatch.setattr("data.readers.READ_BLOCK_BYTES", 256)  # the cuts do not depend on it
    http_server.faults = {"corpus/part-0003.parquet": ["ok", 503, 503], "corpus/part-0006.jsonl.gz": ["drop"],
                          "corpus/part-0010.jsonl": ["ok", "ok", 500, "drop"]}
    first = sorted(corpus.iterdir())[:12]
    prepared = prep(tmp_path / "http", http_urls(http_server, corpus)[:12], num_workers=0, shard_tokens=2000)
    assert not any(http_server.faults.values())  # every fault was met
    assert store_files(prepared) == store_files(prep(tmp_path / "local", [str(path) for path in first],
                                                     num_workers=0, shard_tokens=2000))


def test_a_persistent_error_is_one_line(corpus, http_server, quick_retries, tmp_path, capsys):
    url = f"{http_server.url}/corpus/part-0001.jsonl.gz"
    http_server.faults = {"corpus/part-0001.jsonl.gz": [503] * 3}
    code = prepare_script.main(["config/train_tiny_fsdp.yaml", f"--data.files=[{url}]",
                                f"--data.dataset_dir={tmp_path / 'out'}", "--data.num_workers=0"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1
    assert errors == [f"error: data.files: {url}: HTTP 503 Service Unavailable (a network error, still there "
                      f"after 2 retries)"]


def test_an_object_replaced_while_it_is_read_is_one_line(corpus, http_server, quick_retries, tmp_path, capsys,
                                                         monkeypatch):
    # A retry after a dropped connection (ours, or the HTTP client's own) would continue at the same offset in
    # another file's bytes.
    monkeypatch.setattr(remote, "BLOCK_BYTES", 256)
    monkeypatch.setattr("data.readers.READ_BLOCK_BYTES", 256)
    served = tmp_path / "served"
    shutil.copytree(corpus, served / "corpus")
    http_server.root = served
    url = f"{http_server.url}/corpus/part-0010.jsonl"
    http_server.faults = {"corpus/part-0010.jsonl": ["ok", "replace"]}
    code = prepare_script.main(["config/train_tiny_fsdp.yaml", f"--data.files=[{url}]",
                                f"--data.dataset_dir={tmp_path / 'out'}", "--data.num_workers=0",
                                "--data.vocab_size=400"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: data.files: {url}: changed while it was read (version ")
    assert not any(http_server.faults.values())


# ---------------------------------------------------------------- resuming


@pytest.mark.slow  # prepares the corpus three times
def test_an_interrupted_s3_preparation_resumes_and_a_changed_object_restarts(corpus, local_reference, s3, small_chunks,
                                                                             tmp_path, caplog):
    files = [f"s3://{BUCKET}/corpus/*"]
    root = tmp_path / "prepared"
    with stopped_after(2):
        prep(tmp_path, files, dataset_dir=root, shard_tokens=2000, num_workers=0)
    first_shard = (root / "train-00000.bin").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        resumed = prep(tmp_path, files, dataset_dir=root, shard_tokens=2000, num_workers=0)
    assert "continuing an interrupted preparation after its 2 finished shards" in caplog.text
    assert (root / "train-00000.bin").stat().st_mtime_ns == first_shard
    assert store_files(resumed) == local_reference

    # Interrupted again, then one object is replaced by one of the same size: its ETag tells.
    s3.put_object(Bucket=BUCKET, Key="sub/a.jsonl", Body=jsonl_lines(make_documents(200, seed=1)).encode())
    other = [f"s3://{BUCKET}/sub/*.jsonl"]
    with stopped_after(1):
        prep(tmp_path, other, dataset_dir=tmp_path / "b", shard_tokens=2000, num_workers=0)
    body = jsonl_lines(make_documents(200, seed=1)).replace("alpha", "omega").replace("omega beta", "alpha beta")
    s3.put_object(Bucket=BUCKET, Key="sub/a.jsonl", Body=body.encode())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data.prepare"):
        changed = prep(tmp_path, other, dataset_dir=tmp_path / "b", shard_tokens=2000, num_workers=0)
    assert "continuing" not in caplog.text
    (tmp_path / "c.jsonl").write_text(body)
    assert store_files(changed) == store_files(prep(tmp_path, [str(tmp_path / "c.jsonl")], dataset_dir=tmp_path / "c",
                                                    shard_tokens=2000, num_workers=0))


# ---------------------------------------------------------------- bad inputs


def run_prepare(tmp_path: Path, entry: str, capsys) -> tuple[int, list[str]]:
    code = prepare_script.main(["config/train_tiny_fsdp.yaml", f"--data.files=['{entry}']",  # quoted: YAML
                                f"--data.dataset_dir={tmp_path / 'out'}", "--data.num_workers=0"])
    err = capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written: not even the folder
    return code, [line for line in err.splitlines() if line.startswith("error:")]


def test_s3_bad_inputs_are_one_line_each(s3, tmp_path, capsys, monkeypatch):
    missing = "s3://no-such-bucket-here/corpus/*.jsonl"
    assert run_prepare(tmp_path, missing, capsys) == (
        1, [f"error: data.files: {missing}: the bucket s3://no-such-bucket-here does not exist"])
    nothing = f"s3://{BUCKET}/corpus/*.csv"
    assert run_prepare(tmp_path, nothing, capsys) == (
        1, [f"error: data.files: no .jsonl.gz, .json.gz, .jsonl.zst, .json.zst, .jsonl, .txt, .parquet files match "
            f"{nothing}"])
    from moto import settings

    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks keys: ours are unknown
    code, errors = run_prepare(tmp_path, f"s3://{BUCKET}/corpus/", capsys)
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith(f"error: data.files: s3://{BUCKET}/corpus/: access denied (HTTP 403: "), errors
    assert errors[0].endswith("the credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                              "~/.aws/credentials"), errors
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert run_prepare(tmp_path, f"s3://{BUCKET}/corpus/", capsys) == (
        1, [f"error: data.files: s3://{BUCKET}/corpus/: no credentials found; set AWS_ACCESS_KEY_ID and "
            f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials"])


def test_http_bad_inputs_are_one_line_each_without_secrets(http_server, quick_retries, tmp_path, capsys):
    http_server.forbidden = {"corpus/part-0000.jsonl"}
    host = http_server.url.removeprefix("http://")
    secret = f"http://user:hunter2@{host}/corpus/part-0000.jsonl?token=hunter2"
    assert run_prepare(tmp_path, secret, capsys) == (
        1, [f"error: data.files: http://{host}/corpus/part-0000.jsonl: access denied (HTTP 403)"])
    assert run_prepare(tmp_path, f"http://{host}/corpus/none.jsonl", capsys) == (
        1, [f"error: data.files: http://{host}/corpus/none.jsonl: not found"])


def test_a_server_that_cannot_be_reached_is_a_network_error_not_a_missing_file(quick_retries, tmp_path, capsys):
    import socket

    with socket.socket() as probe:  # a port nothing listens on: every connection is refused
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/corpus/a.jsonl"
    code, errors = run_prepare(tmp_path, url, capsys)
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: data.files: {url}: Cannot connect to host"), errors
    assert errors[0].endswith("(a network error, still there after 2 retries)"), errors


def test_an_http_url_of_another_format_is_refused_before_any_request(quick_retries, tmp_path, capsys):
    url = "http://127.0.0.1:1/corpus/a.csv"  # nothing is asked of this server: it would refuse
    assert run_prepare(tmp_path, url, capsys) == (
        1, [f"error: unsupported data file {url}: expected one of .jsonl.gz, .json.gz, .jsonl.zst, .json.zst, "
            f".jsonl, .txt, .parquet, or for s3:// and gs:// a folder or a glob of them"])


def test_a_scheme_without_its_package_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    assert run_prepare(tmp_path, "gs://bucket/corpus/*.parquet", capsys) == (
        2, ["error: data.files: gs://bucket/corpus/*.parquet needs the package gcsfs (pip install gcsfs)"])
    assert run_prepare(tmp_path, "ftp://host/a.jsonl", capsys) == (
        2, ["error: data.files: ftp://host/a.jsonl: URLs of scheme ftp:// are not read (s3://, gs://, http:// and "
            "https:// are)"])
    assert run_prepare(tmp_path, "hf://datasets/org/name", capsys) == (
        2, ["error: data.files: hf://datasets/org/name: URLs of scheme hf:// are not read (s3://, gs://, http:// and "
            "https:// are); a Hugging Face dataset goes in data.hf_dataset.path"])
    with pytest.raises(DataError, match=r"^data.files: gs://bucket/a.jsonl needs the package gcsfs"):
        prepare_data(tmp_path / "out", PrepareSettings(files=("gs://bucket/a.jsonl",), vocab_size=VOCAB_SIZE))
    assert not (tmp_path / "out").exists()


def test_a_glob_of_http_urls_is_one_line_before_anything_starts(tmp_path, capsys):
    assert run_prepare(tmp_path, "https://example.org/corpus/*.jsonl", capsys) == (
        2, ["error: data.files: https://example.org/corpus/*.jsonl: an http(s):// URL names one file, never a glob "
            "(s3:// and gs:// URLs take globs)"])
    assert remote.url_problem("https://example.org/corpus/a.jsonl?part=1") is None  # a query string is no glob


def test_urls_are_shown_without_secrets():
    assert urls.display("https://me:pw@example.com:8443/a/b.jsonl?X-Amz-Signature=abc#f") == \
        "https://example.com:8443/a/b.jsonl"
    assert urls.scrub("GET 'https://me:pw@h/x?sig=1' failed") == "GET 'https://h/x' failed"
    assert urls.display("/local/path?.jsonl") == "/local/path?.jsonl"


def test_a_url_is_shown_with_its_host_as_written():
    assert urls.display("http://me:pw@[::1]:8080/a.jsonl?sig=1") == "http://[::1]:8080/a.jsonl"
    assert urls.display("s3://My-Bucket/a.jsonl") == "s3://My-Bucket/a.jsonl"


def test_the_resolved_config_holds_no_secret_of_a_url(tmp_path):
    from config.loading import load_config, save_config

    secret = "https://me:hunter2@example.org/corpus/a.jsonl?X-Amz-Signature=hunter2"
    cfg = load_config(None, [f"--data.files=['{secret}', 'local/b.jsonl']"])
    assert cfg.data.files == [secret, "local/b.jsonl"]  # what preparation reads keeps them
    save_config(cfg, tmp_path / "config.yaml")  # also what the trackers are given
    saved = load_config(tmp_path / "config.yaml")
    assert saved.data.files == ["https://example.org/corpus/a.jsonl", "local/b.jsonl"]
    assert "hunter2" not in (tmp_path / "config.yaml").read_text()


# ---------------------------------------------------------------- training, and memory


@pytest.mark.slow  # a training job
def test_training_prepares_and_trains_on_a_corpus_in_s3(s3_server, tmp_path):
    from tests.helpers import read_metrics, run_train

    endpoint, _ = s3_server
    files = f"s3://{BUCKET}/corpus/*.jsonl"
    run_train("--train.max_steps=3", out_dir=tmp_path / "out", corpus=files,  # type: ignore[arg-type]
              dataset_dir=tmp_path / "prepared", extra_env=aws_env(endpoint))
    losses = [row["loss"] for row in read_metrics(tmp_path / "out") if "loss" in row]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses), losses
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    assert meta["inputs"] == [files]
    assert meta["num_train_documents"] + meta["num_val_documents"] == NUM_FILES // len(FORMATS) * 6


def _serve_s3(conn) -> None:
    """moto's S3 server, in a process of its own until told to stop: it keeps its objects in memory and reads one
    whole for each ranged GET, which must not count as the reader's."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port())
    conn.recv()
    server.stop()


@pytest.mark.slow  # a server process and an object of 64 MB
def test_an_object_streamed_from_s3_is_read_in_bounded_memory(monkeypatch):
    """The bytes the streaming path holds while it reads an object into pieces, measured by tracemalloc (this
    process's allocations, fsspec's, aiohttp's and the reader's buffers among them), not the resident size of a
    machine's processes, which other work on it moves."""
    from data.prepare import CHUNK_BYTES
    from data.readers import expand_inputs, read_pieces

    fork = multiprocessing.get_context("fork")
    here, there = fork.Pipe()
    server = fork.Process(target=_serve_s3, args=(there,), daemon=True)
    server.start()
    try:
        host, port = here.recv()
        for name, value in aws_env(f"http://{host}:{port}").items():
            monkeypatch.setenv(name, value)
        line = (json.dumps({"text": "the same words again " * 100}) + "\n").encode()
        body = line * (64 * 2**20 // len(line))
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="big.jsonl", Body=body)
        size = len(body)
        del body
        (remote_file,) = expand_inputs([f"s3://{BUCKET}/big.jsonl"])  # the store's client made before measuring
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            read = sum(piece.num_bytes for piece in read_pieces(remote_file, piece_bytes=CHUNK_BYTES, text_field="text",
                                                                max_document_mb=64, skip_long=False))
            held = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
    finally:
        here.send("stop")
        server.join(timeout=30)
    assert read == size
    # fsspec fetches remote.BLOCK_BYTES at a time, one block ahead; the fetched block is held at most three times
    # (the parts aiohttp receives, their join, the read-ahead cache's previous block), beside a piece of CHUNK_BYTES
    # and the lines around it: 3 x 8 MB + 6 MB measured. Held whole, the object alone would be 64 MB (twice that
    # measured, with fsspec's copy).
    bound = 3 * remote.BLOCK_BYTES + 8 * 2**20
    assert bound < size  # the object is larger than what reading it may hold
    assert held < bound, f"{held / 2**20:.1f} MB held"
