"""data.files URLs against hostile or broken servers, started here on 127.0.0.1: credentials and unparsable
URLs, servers that never answer or stall, a Content-Length that lies, and library errors of several lines."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from data import DataError, PrepareSettings, prepare_data, remote
from scripts import prepare_data as prepare_script
from tests.test_data import VOCAB_SIZE, make_documents
from tests.test_prepare import jsonl_lines
from tests.test_remote_sources import BUCKET, aws_env, corpus, s3, s3_server  # noqa: F401 - fixtures

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
    assert remote.display(url) == shown


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
