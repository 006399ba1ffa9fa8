"""data.files URLs against hostile or broken servers, started here on 127.0.0.1: credentials and unparsable
URLs, servers without validators, bodies without end, servers that never answer or stall, a Content-Length that
lies, and content that changes between the passes of a preparation under the same ETag."""
from __future__ import annotations

import gzip
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from data import DataError, PrepareSettings, prepare_data, remote
from data.prepare import PROGRESS_NAME, _Preparation
from data.store import ShardWriter, read_record
from safe_io import urls
from scripts import prepare_data as prepare_script
from tests.test_data import VOCAB_SIZE, make_documents
from tests.test_prepare import jsonl_lines, store_files
from tests.test_remote_sources import BUCKET, aws_env, corpus, s3, s3_server  # noqa: F401 - fixtures

zstandard = pytest.importorskip("zstandard")
pytest.importorskip("aiohttp")
pytest.importorskip("s3fs")

DEADLINE_S = 30.0  # a call that takes longer is one that would wait for aiohttp's own bounds (minutes), or forever
TIMEOUT_S = 0.5  # data.remote_timeout_s in these tests


# ---------------------------------------------------------------- the server


class Handler(BaseHTTPRequestHandler):
    """Serves server.files from memory, HEAD and GET (with byte ranges), as server.mode says: "serve"; "silent"
    (the connection is accepted, the request read, and nothing answered); "stall" (a GET's headers and half its
    body, then nothing); "endless" (a chunked body without end, of server.filler); "short" (a Content-Length of
    10 before the whole body). ETag only where server.etag is set: a constant, whatever the content."""

    protocol_version = "HTTP/1.1"
    server: HostileServer

    def log_message(self, format, *args) -> None:  # noqa: A002 - the standard library's signature
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)  # bounds what a body without end
        # puts in flight beyond what the client reads

    def do_HEAD(self) -> None:  # noqa: N802 - the standard library's name
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        server = self.server
        data = server.files.get(urlsplit(self.path).path.lstrip("/"), b"")
        if server.mode == "silent" or (server.mode == "stall" and body):
            start, end = self._range(len(data))
            if server.mode == "stall":
                self._headers(206, end - start, len(data), start)
                self._send(data[start : start + (end - start) // 2])
            server.stop.wait()
            self.close_connection = True
            return
        if server.mode == "endless":
            self._headers(200, None, None, 0)
            while body and not server.stop.is_set() and self._send(b"%x\r\n%s\r\n" % (len(server.filler),
                                                                                       server.filler)):
                pass
            self.close_connection = True
            return
        if server.mode == "short" and body:
            self._headers(200, 10, None, 0)
            self._send(data)
            return
        start, end = self._range(len(data)) if body else (0, len(data))
        self._headers(206 if end - start < len(data) else 200, end - start if server.sized else None, len(data), start)
        if body:
            self._send(data[start:end] if server.sized else b"%x\r\n%s\r\n0\r\n\r\n" % (end - start, data[start:end]))

    def _range(self, size: int) -> tuple[int, int]:
        first, _, last = self.headers.get("Range", "").removeprefix("bytes=").partition("-")
        return (int(first), min(int(last) + 1, size)) if first else (0, size)

    def _headers(self, status: int, length: int | None, size: int | None, start: int) -> None:
        self.send_response(status)
        if length is None:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(length))
            if status == 206 and size is not None:
                self.send_header("Content-Range", f"bytes {start}-{start + length - 1}/{size}")
        if self.server.etag:
            self.send_header("ETag", self.server.etag)
        self.end_headers()

    def _send(self, data: bytes) -> bool:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            return False
        with self.server.lock:
            self.server.sent += len(data)
        return True


class HostileServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.mode = "serve"
        self.sized = True  # a Content-Length, else a chunked body
        self.etag = ""
        self.filler = b""
        self.sent = 0  # bytes of bodies written
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"


@pytest.fixture
def server() -> Iterator[HostileServer]:
    server = HostileServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.stop.set()  # frees the handlers that wait
    server.shutdown()
    server.server_close()


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(remote, "RETRIES", 2)
    monkeypatch.setattr(remote, "RETRY_DELAY_S", 0.01)


def within_deadline(call: Callable[[], object]) -> tuple[object, float]:
    """call()'s result (or the exception it raised) and its seconds; a failure past DEADLINE_S (the call goes on in
    its thread until the server's teardown frees it)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome.append(err)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert outcome, f"still waiting after {DEADLINE_S:.0f} s"
    return outcome[0], time.monotonic() - start


def settings(files: list[str], **overrides) -> PrepareSettings:
    return PrepareSettings(files=tuple(files), vocab_size=VOCAB_SIZE, val_fraction=0.1, seed=7, num_workers=0,
                           remote_timeout_s=TIMEOUT_S, **overrides)


def error_lines(capsys) -> tuple[list[str], str]:
    captured = capsys.readouterr()
    return [line for line in captured.err.splitlines() if line.startswith("error:")], captured.out + captured.err


# ---------------------------------------------------------------- URLs refused with the config's errors


def refused_with_the_config(url: str, tmp_path, capsys) -> list[tuple[list[str], str]]:
    """The error lines and whole output of scripts/prepare_data.py and of `train_fsdp.py --check` for data.files=[url],
    each of which exits 2 (a config error) without writing anything."""
    import train_fsdp

    found = []
    for main, args in ((prepare_script.main, [f"--data.dataset_dir={tmp_path / 'out'}"]),
                       (train_fsdp.main, ["--check"])):
        assert main(["config/train_tiny_fsdp.yaml", f"--data.files=['{url}']", *args]) == 2
        found.append(error_lines(capsys))
    assert not (tmp_path / "out").exists()
    return found


SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCY"  # an AWS-like secret key: it holds a '/'


@pytest.mark.parametrize("url, shown", [
    (f"s3://AKIAIOSFODNN7:{SECRET.replace('/', '')}@{BUCKET}/corpus/*.jsonl", f"s3://{BUCKET}/corpus/*.jsonl"),
    (f"s3://AKIAIOSFODNN7:{SECRET}@{BUCKET}/corpus/a.jsonl", f"s3://{BUCKET}/corpus/a.jsonl"),  # '/' in it
    (f"gs://AKIAIOSFODNN7:{SECRET}@{BUCKET}/corpus/", f"gs://{BUCKET}/corpus/"),
])
def test_credentials_in_a_store_url_are_refused_in_one_line_without_them(url, shown, tmp_path, capsys):
    scheme = shown[:2]
    for errors, output in refused_with_the_config(url, tmp_path, capsys):
        assert errors == [f"error: data.files: {shown}: the URL holds credentials, which are refused (a URL shows in "
                          f"logs and process lists); {scheme}:// takes them from {remote.CREDENTIALS_HELP[scheme]}"]
        assert "AKIAIOSFODNN7" not in output and "wJalr" not in output


@pytest.mark.parametrize("url, shown", [
    ("http://[::1/x.jsonl", "http://[::1/x.jsonl"),
    ("https://example.org:99999/x.jsonl", "https://example.org:99999/x.jsonl"),
    ("http://user:pa55/w0rd@127.0.0.1:1/x.jsonl?sig=hunter2", "http://127.0.0.1:1/x.jsonl"),  # '/' not escaped
])
def test_a_url_that_does_not_parse_is_one_line_naming_it(url, shown, tmp_path, capsys):
    for errors, output in refused_with_the_config(url, tmp_path, capsys):
        assert errors == [f"error: data.files: {shown}: not a valid URL: its host or port cannot be read (a user or "
                          f"password holding '/', '?', '#' or '@' is written percent-encoded)"]
        assert "Traceback" not in output and "w0rd" not in output and "hunter2" not in output
    assert urls.display(url) == shown


def test_remote_timeout_s_is_checked_with_the_config(capsys):
    import train_fsdp

    assert train_fsdp.main(["config/train_tiny_fsdp.yaml", "--check", "--data.remote_timeout_s=0"]) == 2
    assert error_lines(capsys)[0] == ["error: data.remote_timeout_s must be in (0, 10**9] seconds, got 0.0"]


# ---------------------------------------------------------------- servers that never answer


def test_a_server_that_never_answers_fails_after_the_timeout_and_retries(server, quick_retries, tmp_path):
    server.mode = "silent"
    url = server.url("a.jsonl")
    err, seconds = within_deadline(lambda: prepare_data(tmp_path / "out", settings([url])))
    assert isinstance(err, DataError)
    assert str(err) == (f"data.files: {url}: no answer within data.remote_timeout_s (Timeout on reading data from "
                        f"socket) (a network error, still there after 2 retries)")
    # 3 attempts of a HEAD and a GET (fsspec's way to a size), each TIMEOUT_S: no more.
    assert 6 * TIMEOUT_S <= seconds < 6 * TIMEOUT_S + 5
    assert not (tmp_path / "out").exists()


def test_a_server_that_stalls_mid_body_fails_after_the_timeout_and_retries(server, quick_retries, tmp_path):
    server.files["a.jsonl"] = jsonl_lines(make_documents(50)).encode()
    server.mode = "stall"  # HEAD answers; every GET sends half of what it was asked, then nothing
    url = server.url("a.jsonl")
    err, seconds = within_deadline(lambda: prepare_data(tmp_path / "out", settings([url])))
    assert isinstance(err, DataError)
    assert str(err).startswith(f"data.files: {url}: no answer within data.remote_timeout_s"), err
    assert str(err).endswith("(a network error, still there after 2 retries)"), err
    assert 3 * TIMEOUT_S <= seconds < 3 * TIMEOUT_S + 5


def test_an_s3_endpoint_that_never_answers_fails_after_the_timeout_and_retries(quick_retries, tmp_path, monkeypatch):
    with socket.socket() as listener:  # accepts connections (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        for name, value in aws_env(f"http://127.0.0.1:{listener.getsockname()[1]}").items():
            monkeypatch.setenv(name, value)
        url = f"s3://{BUCKET}/corpus/a.jsonl"
        err, seconds = within_deadline(lambda: prepare_data(tmp_path / "out", settings([url])))
    assert isinstance(err, DataError)
    assert str(err).startswith(f"data.files: {url}: no answer within data.remote_timeout_s (Read timeout on "), err
    assert str(err).endswith("(a network error, still there after 2 retries)"), err
    assert 3 * TIMEOUT_S <= seconds < 3 * TIMEOUT_S + 5  # botocore's and s3fs's retries would multiply it


# ---------------------------------------------------------------- no validator: the content is hashed


def test_a_file_without_validator_changed_at_the_same_size_is_prepared_again(server, tmp_path, caplog):
    documents = make_documents(120, seed=3)
    old, new = jsonl_lines(documents), jsonl_lines([text.replace("x", "y") for text in documents])
    assert len(old) == len(new) and old != new
    server.files["a.jsonl"] = old.encode()  # served without ETag or Last-Modified
    url = server.url("a.jsonl")
    with caplog.at_level(logging.INFO):
        prepare_data(tmp_path / "out", settings([url]), show_progress=False)
        assert f"{url}: its server gives no ETag or Last-Modified, so its content is hashed" in caplog.text
        caplog.clear()
        prepare_data(tmp_path / "out", settings([url]), show_progress=False)  # unchanged: reused
        assert "using the data prepared earlier" in caplog.text
        assert f"{url}: its server gives no ETag or Last-Modified, so its content is hashed" in caplog.text
        server.files["a.jsonl"] = new.encode()
        caplog.clear()
        changed = prepare_data(tmp_path / "out", settings([url]), show_progress=False)
        assert "using the data prepared earlier" not in caplog.text
    (tmp_path / "new.jsonl").write_text(new)
    assert store_files(changed) == store_files(prepare_data(tmp_path / "local", settings([str(tmp_path / "new.jsonl")]),
                                                            show_progress=False))


def test_a_file_of_unknown_size_without_validator_changed_at_the_same_size_is_prepared_again(server, tmp_path):
    documents = make_documents(120, seed=4)
    server.sized = False  # a chunked body: no size either
    server.files["a.jsonl"] = jsonl_lines(documents).encode()
    url = server.url("a.jsonl")
    first = store_files(prepare_data(tmp_path / "out", settings([url]), show_progress=False))
    server.files["a.jsonl"] = jsonl_lines(documents[::-1]).encode()  # the same bytes in another order
    assert store_files(prepare_data(tmp_path / "out", settings([url]), show_progress=False)) != first


# ---------------------------------------------------------------- bodies without end


@pytest.mark.parametrize("etag", ["", '"constant"'])
def test_a_body_without_end_stops_at_max_in_job_mb(etag, server, tmp_path):
    server.mode, server.etag = "endless", etag  # without a validator it is hashed first, with one read by the passes
    server.filler = b'{"text": "more"}\n' * 4096
    url = server.url("a.jsonl")
    err, _ = within_deadline(lambda: prepare_data(tmp_path / "out", settings([url]), max_input_mb=1,
                                                  show_progress=False))
    assert isinstance(err, DataError)
    assert str(err) == (f"data.files: {url}: the corpus passed data.max_in_job_mb=1 MB while this file was read, more "
                        f"than a training job prepares: prepare it first with `python scripts/prepare_data.py CONFIG "
                        f"--data.dataset_dir=DIR`, then train with --data.dataset_dir=DIR")
    assert server.sent < 16 << 20  # what the sockets' buffers hold beyond the MB read


def test_a_stream_of_frames_without_text_stops_at_max_corpus_mb(server, tmp_path):
    server.mode, server.etag = "endless", '"constant"'
    server.filler = struct.pack("<II", 0x184D2A50, 1 << 16) + bytes(1 << 16)  # zstd's skippable frame: no text
    url = server.url("a.jsonl.zst")
    err, _ = within_deadline(lambda: prepare_data(tmp_path / "out", settings([url], max_corpus_mb=1,
                                                                             max_document_mb=1), show_progress=False))
    assert isinstance(err, DataError)
    assert str(err) == (f"data.files: {url}: more than 19 MB read of URLs whose size is not given (no "
                        f"Content-Length), more than data.max_corpus_mb=1 MB of text can need (twice it and "
                        f"data.max_document_mb, and 16 MB): a stream without end?")
    assert server.sent < 40 << 20


def test_a_text_stream_without_end_or_validator_is_read_up_to_max_corpus_mb(server, tmp_path):
    server.mode = "endless"
    server.filler = jsonl_lines(make_documents(40, seed=5)).encode()
    prepared, _ = within_deadline(lambda: prepare_data(tmp_path / "out", settings([server.url("a.jsonl")],
                                                                                  max_corpus_mb=0.25,
                                                                                  max_document_mb=0.25),
                                                       show_progress=False))
    assert not isinstance(prepared, BaseException), prepared
    # The hash reads as far as a preparation may (2 * 0.25 + 0.25 + 16 MB), each pass about 0.25 MB; the rest is
    # what the sockets of the five requests (fsspec's HEAD and GET for the size, and a GET per read) buffer.
    assert server.sent < 64 << 20


# ---------------------------------------------------------------- what the messages hold


def test_a_short_content_length_is_one_line_without_the_body(server, quick_retries, tmp_path, capsys):
    body = jsonl_lines([f"the body's secret line {i}" for i in range(200)]).encode()
    server.files["a.jsonl"], server.etag, server.mode = body, '"e"', "short"
    url = server.url("a.jsonl")
    code = prepare_script.main(["config/train_tiny_fsdp.yaml", f"--data.files=['{url}']",
                                f"--data.dataset_dir={tmp_path / 'out'}", "--data.num_workers=0"])
    errors, output = error_lines(capsys)
    assert code == 1
    assert errors == [f"error: data.files: {url}: a malformed HTTP response (Bad status line)"]
    assert "secret line" not in output


def test_a_library_error_of_several_lines_is_one(s3, tmp_path, capsys):  # noqa: F811 - the fixture
    code = prepare_script.main(["config/train_tiny_fsdp.yaml", "--data.files=['s3://bad!bucket/corpus/a.jsonl']",
                                f"--data.dataset_dir={tmp_path / 'out'}"])
    errors, output = error_lines(capsys)
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith("error: data.files: s3://bad!bucket/corpus/a.jsonl: Parameter validation failed: "
                                "Invalid bucket name"), errors
    assert len(output.strip().splitlines()) == 1, output
    assert len(errors[0]) < len("error: data.files: s3://bad!bucket/corpus/a.jsonl: ") + remote.MESSAGE_CHARS + 1


def test_a_message_holds_no_secret_of_the_url_nor_quoted_bytes():
    url = "https://me:hunter22@example.org/a.jsonl?token=hunter33"
    err = ValueError("failed for me:hunter22 with token=hunter33:\n  b'{\"text\": \"private\"}'\n\x1b[2J")
    # The escape character goes (what follows it is plain text then).
    assert str(remote.remote_error(url, err)) == ("data.files: https://example.org/a.jsonl: failed for ... with ...: "
                                                  "... [2J")


# ---------------------------------------------------------------- content changed between the passes


def changed_after_the_first_pass(server: HostileServer, name: str, content: bytes, monkeypatch) -> None:
    """The tokenizer's pass over the corpus done, the served file becomes `content`."""
    first_pass = _Preparation.tokenizer_sample

    def then_change(self):
        documents = first_pass(self)
        server.files[name] = content
        return documents

    monkeypatch.setattr(_Preparation, "tokenizer_sample", then_change)


@pytest.mark.parametrize("etag", ['"the-same"', ""])
def test_content_changed_between_the_passes_is_refused_and_nothing_of_it_kept(etag, server, tmp_path, monkeypatch):
    documents = make_documents(200, seed=6)
    old, new = jsonl_lines(documents).encode(), jsonl_lines(documents[::-1]).encode()
    server.files["a.jsonl"], server.etag = old, etag
    url = server.url("a.jsonl")
    changed_after_the_first_pass(server, "a.jsonl", new, monkeypatch)
    # Small reads and work units: shards of the new content are finished before the end of the file tells.
    monkeypatch.setattr("data.readers.READ_BLOCK_BYTES", 256)
    monkeypatch.setattr("data.prepare.CHUNK_BYTES", 1024)
    finished = []
    finish_shard = ShardWriter.finish_shard
    monkeypatch.setattr(ShardWriter, "finish_shard", lambda self, **kw: finished.append(finish_shard(self, **kw)))
    root = tmp_path / "out"
    with pytest.raises(DataError, match="changed while it was read") as caught:
        prepare_data(root, settings([url], shard_tokens=500), show_progress=False)
    assert finished
    why = f"the same version {etag}" if etag else "no ETag or Last-Modified"
    assert str(caught.value) == (f"data.files: {url}: changed while it was read (its first {len(old):,} bytes "
                                 f"differ from an earlier read's, with {why}): prepare again once it no longer "
                                 f"changes")
    assert read_record(root / PROGRESS_NAME)["shards"] == []  # none kept: a rerun starts again
    monkeypatch.undo()
    (tmp_path / "new.jsonl").write_bytes(new)
    rerun = prepare_data(root, settings([url], shard_tokens=500), show_progress=False)
    assert store_files(rerun) == store_files(prepare_data(tmp_path / "local", settings([str(tmp_path / "new.jsonl")],
                                                                                      shard_tokens=500),
                                                          show_progress=False))


def test_a_gzip_file_that_grows_between_the_passes_is_refused(server, tmp_path, monkeypatch):
    old = gzip.compress(jsonl_lines(make_documents(100, seed=8)).encode(), mtime=0)
    server.files["a.jsonl.gz"], server.sized, server.etag = old, False, '"the-same"'  # chunked: read as a stream
    changed_after_the_first_pass(server, "a.jsonl.gz", old + gzip.compress(b'{"text": "more"}\n', mtime=0),
                                 monkeypatch)
    with pytest.raises(DataError, match=rf"changed while it was read \(it goes on past the {len(old):,} bytes an "):
        prepare_data(tmp_path / "out", settings([server.url("a.jsonl.gz")]), show_progress=False)


def test_a_parquet_file_of_unknown_size_is_one_line(server, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": make_documents(50)}), path)
    server.files["a.parquet"], server.sized, server.etag = path.read_bytes(), False, '"e"'
    url = server.url("a.parquet")
    with pytest.raises(DataError) as caught:
        prepare_data(tmp_path / "out", settings([url]), show_progress=False)
    assert str(caught.value) == (f"data.files: {url}: its server gives no size (no Content-Length), which reading "
                                 f"this file needs (a parquet file is read from its end)")
