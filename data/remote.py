"""data.files entries that are URLs: object stores (s3://, gs://) and HTTP(S), read as streams through fsspec,
imported only when such a URL is given, with the credentials found where they always are (never in the config).
A URL in a message has no user, password or query string; a transient network error is retried RETRIES times with
backoff, a read continuing where it stopped (docs/data.md). Every read from a file's start hashes what it reads, so
a later pass finds content that changed without a new ETag; a stream of no known size is read within FetchLimit."""
from __future__ import annotations

import errno
import glob
import hashlib
import importlib
import importlib.util
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, TypeVar
from urllib.parse import urlsplit

from safe_io.urls import STORE_SCHEMES, display, is_url, scheme_of, scrub, split_url

from .errors import DataError

# scheme -> the package fsspec needs for it
PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp", "https": "aiohttp"}
RETRIES = 5
RETRY_DELAY_S = 0.5  # before the first retry; doubled before each next one
# fsspec fetches a file in requests of this size, one block ahead: what one open file holds in memory.
BLOCK_BYTES = 8 << 20
TIMEOUT_S = 30.0  # data.remote_timeout_s's default: to connect, and between two arrivals of a response's bytes
MESSAGE_CHARS = 300  # a library's error text is cut to this in a message

log = logging.getLogger(__name__)

_BYTES_IN_TEXT = re.compile(r"""\bb(?:'(?:[^'\\]|\\.)*'?|"(?:[^"\\]|\\.)*"?)""")  # a bytes repr: a response's body
# Error types (by name, so that none of their packages is imported here) of a connection that failed or broke.
_TRANSIENT_TYPES = {"ClientConnectionError", "ClientPayloadError", "ServerTimeoutError", "FSTimeoutError",
                    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
                    "IncompleteRead", "ResponseStreamingError"}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"}
_TIMEOUT_TYPES = {"ServerTimeoutError", "FSTimeoutError", "ReadTimeoutError", "ConnectTimeoutError"}
_CREDENTIAL_TYPES = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}
CREDENTIALS_HELP = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials",
                    "gs": "GOOGLE_APPLICATION_CREDENTIALS or `gcloud auth application-default login`"}
CREDENTIALS_HELP["gcs"] = CREDENTIALS_HELP["gs"]

T = TypeVar("T")


def url_problem(entry: str) -> str | None:
    """Why a URL entry cannot be read here (an unknown scheme, a URL that does not parse or carries credentials,
    a package not installed), or None."""
    scheme = scheme_of(entry)
    if scheme is None:
        return None
    if scheme not in PACKAGES:
        hint = "; a Hugging Face dataset goes in data.hf_dataset.path" if scheme == "hf" else ""
        return (f"data.files: {display(entry)}: URLs of scheme {scheme}:// are not read (s3://, gs://, http:// and "
                f"https:// are){hint}")
    if problem := _form_problem(entry, scheme):
        return f"data.files: {display(entry)}: {problem}"
    if scheme not in STORE_SCHEMES and glob.has_magic(urlsplit(entry).path):
        return (f"data.files: {display(entry)}: an http(s):// URL names one file, never a glob (s3:// and gs:// URLs "
                f"take globs)")
    for package in ("fsspec", PACKAGES[scheme]):
        if importlib.util.find_spec(package) is None:
            return f"data.files: {display(entry)} needs the package {package} (pip install {package})"
    return None


def _form_problem(entry: str, scheme: str) -> str | None:
    """What is wrong with the URL's form: credentials in a store's URL, a host or port that does not parse."""
    parts = split_url(entry)
    if scheme in STORE_SCHEMES and "@" in (entry.partition("://")[2] if parts is None else parts.netloc):
        return (f"the URL holds credentials, which are refused (a URL shows in logs and process lists); {scheme}:// "
                f"takes them from {CREDENTIALS_HELP[scheme]}")
    if parts is None:
        return ("not a valid URL: its host or port cannot be read (a user or password holding '/', '?', '#' or '@' "
                "is written percent-encoded)")
    if not parts.hostname:
        return f"names no {'bucket' if scheme in STORE_SCHEMES else 'host'}"
    return None


class SourceChanged(DataError):
    """A file of the corpus changed while it was read: what was prepared from it may mix two versions."""


@dataclass
class FetchLimit:
    """A bound on the bytes fetched from the URLs it is given to, together. Each file counts as far as any read of
    it got (every pass over the corpus reads the same bytes again), so the total is the corpus as far as read."""

    max_bytes: int
    problem: str  # what passing the bound means and what to do: the end of the error line
    furthest: dict[str, int] = field(default_factory=dict)
    total: int = 0

    def reached(self, url: str, position: int) -> None:
        """A read of url got to position: DataError once the files together hold more than max_bytes."""
        before = self.furthest.get(url, 0)
        if position > before:
            self.furthest[url] = position
            self.total += position - before
            if self.total > self.max_bytes:
                raise DataError(f"data.files: {display(url)}: {self.problem}")


@dataclass
class Seen:
    """What reads of a file from its start found, for later reads to be checked against: the SHA-256 of its
    first `length` bytes, and whether the file ended there."""

    length: int = 0
    digest: str = ""
    ended: bool = False


@dataclass(frozen=True)
class RemoteFile:
    """One file of a store or HTTP server, with what the store says of it when it was listed."""

    url: str  # as given to fsspec (an http URL keeps its query string)
    size: int  # 0 where the server does not say (sized is False)
    version: str  # the ETag, else the modification time (a changed object has another); "" where neither is given
    fs: Any = field(compare=False, repr=False)  # the fsspec filesystem (fsspec has no type hints)
    sized: bool = True  # the server gave the size (an HTTP response without Content-Length does not)
    limits: tuple[FetchLimit, ...] = field(default=(), compare=False, repr=False)  # bounds on what reads fetch
    seen: Seen = field(default_factory=Seen, compare=False, repr=False)  # shared by every read of the file

    @property
    def name(self) -> str:
        return PurePosixPath(urlsplit(self.url).path).name

    def __str__(self) -> str:
        return display(self.url)

    def identity(self, *, hash_bytes: int = 0) -> list:
        """What the preparation's fingerprint holds of this file: a changed object changes it. Its URL, size and
        ETag (or modification time); where the server gives neither, the SHA-256 of its content, read now (see
        content_digest for hash_bytes)."""
        return [display(self.url), self.size, self.version or f"sha256:{self.content_digest(hash_bytes)}"]

    def content_digest(self, max_bytes: int = 0) -> str:
        """The SHA-256 of the file's content, read through once now; a file of unknown size only up to max_bytes
        (> 0), as much as any preparation may read of it. Later reads of the same bytes are checked against it."""
        log.info("%s: its server gives no ETag or Last-Modified, so its content is hashed (read through once) to tell "
                 "whether it changed", self)
        bound = max_bytes if max_bytes and not self.sized else 0
        with self.open() as reader:
            while not reader.ended and not (bound and reader.position >= bound):
                reader.read(min(BLOCK_BYTES, bound - reader.position) if bound else BLOCK_BYTES)
            return reader.digest()

    def open(self) -> RemoteReader:
        return RemoteReader(self)


def expand_url(entry: str, accept: Callable[[str], bool], supported: str, *,
               timeout_s: float = TIMEOUT_S) -> list[RemoteFile]:
    """The files a URL entry names: one file, every accepted file below a folder of a store, or a glob's matches
    (sorted by URL; a listing is read to its end, however many pages it takes). A request that gets no answer for
    timeout_s is a network error."""
    if problem := url_problem(entry):
        raise DataError(problem)
    scheme = scheme_of(entry)
    assert scheme is not None
    fs = _filesystem(entry, scheme, timeout_s)
    if scheme not in STORE_SCHEMES:  # a store's folders and globs are listed; an http(s) URL names one file
        _check_format(entry, accept, supported)  # before any request
        return [_one_file(fs, entry, _call(entry, fs.info, entry), accept, supported)]
    if glob.has_magic(entry):
        found = _call(entry, fs.glob, entry, detail=True)
    else:
        info = _call(entry, fs.info, entry)
        if info.get("type") != "directory":
            return [_one_file(fs, entry, info, accept, supported)]
        found = _call(entry, fs.find, entry, detail=True)
    files = [_remote_file(fs, scheme, info) for info in found.values()
             if info.get("type") == "file" and accept(PurePosixPath(info["name"]).name)]
    if not files:
        bucket = _bucket(entry)
        if not _call(entry, _exists, fs, bucket):
            raise DataError(f"data.files: {display(entry)}: the bucket {display(bucket)} does not exist")
        raise DataError(f"data.files: no {supported} files match {display(entry)}")
    return sorted(files, key=lambda remote: remote.url)


def _exists(fs, bucket: str) -> bool:
    try:
        fs.info(bucket)
    except FileNotFoundError:
        return False
    return True


def _filesystem(entry: str, scheme: str, timeout_s: float):
    """A new filesystem object: fsspec's cached one would keep the listings and settings of an earlier call."""
    fsspec = importlib.import_module("fsspec")
    try:
        fs = fsspec.filesystem(scheme, skip_instance_cache=True, **_options(scheme, timeout_s))
    except ImportError:
        raise DataError(f"data.files: {display(entry)} needs the package {PACKAGES[scheme]} "
                        f"(pip install {PACKAGES[scheme]})") from None
    if scheme == "s3":
        fs.retries = 1  # s3fs's own retries (its only setting is this attribute) would multiply ours
    return fs


def _options(scheme: str, timeout_s: float) -> dict:
    """The filesystem's settings: timeout_s to connect and between two arrivals of a response's bytes (aiohttp's
    own bound is minutes a request), and no retries beneath ours, which would multiply the time a server that
    does not answer takes to be named."""
    if scheme == "s3":
        return {"config_kwargs": {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                                  "retries": {"total_max_attempts": 1}}}
    aiohttp = importlib.import_module("aiohttp")
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    if scheme in STORE_SCHEMES:  # gcsfs
        return {"requests_timeout": timeout}
    return {"block_size": BLOCK_BYTES, "client_kwargs": {"timeout": timeout}}


def _bucket(entry: str) -> str:
    parts = urlsplit(entry)
    return f"{parts.scheme}://{parts.netloc}"


def _check_format(entry: str, accept: Callable[[str], bool], supported: str) -> None:
    if not accept(PurePosixPath(urlsplit(entry).path).name):
        raise DataError(f"unsupported data file {display(entry)}: expected one of {supported}, or for s3:// and "
                        f"gs:// a folder or a glob of them")


def _one_file(fs, entry: str, info: dict, accept: Callable[[str], bool], supported: str) -> RemoteFile:
    _check_format(entry, accept, supported)
    return _remote_file(fs, scheme_of(entry) or "", {**info, "name": entry})


def _remote_file(fs, scheme: str, info: dict) -> RemoteFile:
    name = info["name"]
    url = name if is_url(name) else f"{scheme}://{name}"
    return RemoteFile(url, int(info.get("size") or 0), _version(info), fs, sized=info.get("size") is not None)


def _version(info: dict) -> str:
    """What a store says of an object that changes when it is replaced: its ETag, else its modification time."""
    return next((str(info[key]) for key in ("ETag", "etag", "md5Hash", "LastModified", "mtime", "updated",
                                            "Last-Modified") if info.get(key)), "")


class RemoteReader:
    """A read-only, seekable binary file of a RemoteFile. On a transient error it is opened again where the
    read stopped, up to RETRIES times with backoff; any other error, or the last, is one DataError line.

    While reads follow each other from the file's start, they are hashed, and checked where an earlier such read
    of the file stopped (a read that would pass that point stops there): different bytes, or an end found
    elsewhere, is a SourceChanged error. Every read counts against the file's FetchLimits."""

    def __init__(self, remote: RemoteFile):
        self.remote = remote
        self.position = 0
        self.closed = False
        self.ended = False  # a read found the end of the file
        self.hash: Any = hashlib.sha256()  # of the bytes read from the start; None once a seek went elsewhere
        self.checked = False  # against remote.seen, where it stops
        self.changed = False
        self.file = _call(remote.url, self._open)

    def _open(self):
        file = self.remote.fs.open(self.remote.url, "rb", block_size=BLOCK_BYTES)
        file.seek(self.position)
        return file

    def _reopen(self) -> None:
        """A new file at the same position: the old one's connection or cache may be broken. An object replaced
        since it was listed would continue with another file's bytes: that is an error, not a retry."""
        try:
            self.file.close()
        except Exception:  # noqa: BLE001, S110 - a broken connection's file may fail to close; it is dropped
            pass
        self.verify()
        self.file = _call(self.remote.url, self._open)

    def verify(self) -> None:
        """The object is still the one listed. The HTTP client may itself repeat a request whose connection
        dropped, so a file replaced while it was read is caught here, after the read, as well as on a retry."""
        self.remote.fs.invalidate_cache(self.remote.url)
        now = _version(_call(self.remote.url, self.remote.fs.info, self.remote.url))
        if self.remote.version and now != self.remote.version:
            self.changed = True
            raise SourceChanged(f"data.files: {self.remote}: changed while it was read (version "
                                f"{self.remote.version} when listed, {now} now): prepare again once it no longer "
                                f"changes")

    def read(self, size: int = -1) -> bytes:
        seen = self.remote.seen
        if self.hash is not None and self.position < seen.length and (size < 0 or self.position + size > seen.length):
            size = seen.length - self.position  # stop where an earlier read from the start stopped, to compare
        data = _call(self.remote.url, lambda: self.file.read(size), before_retry=self._reopen)
        self.position += len(data)
        self.ended = self.ended or (not data and size != 0)
        for limit in self.remote.limits:
            limit.reached(self.remote.url, self.position)
        if self.hash is not None:
            self.hash.update(data)
            self._check(seen)
        return data

    def _check(self, seen: Seen) -> None:
        """The bytes read from the start against what an earlier read from the start found."""
        if not seen.length:
            return
        if self.position == seen.length and not self.checked:
            self.checked = True
            if self.digest() != seen.digest:
                raise self._changed(f"its first {seen.length:,} bytes differ from an earlier read's")
        if seen.ended and self.position > seen.length:
            raise self._changed(f"it goes on past the {seen.length:,} bytes an earlier read found")
        if self.ended and self.position < seen.length:
            raise self._changed(f"it ends after {self.position:,} bytes, where an earlier read found {seen.length:,}")

    def _changed(self, detail: str) -> SourceChanged:
        self.changed = True
        why = f"the same version {self.remote.version}" if self.remote.version else "no ETag or Last-Modified"
        return SourceChanged(f"data.files: {self.remote}: changed while it was read ({detail}, with {why}): prepare "
                             f"again once it no longer changes")

    def digest(self) -> str:
        """The SHA-256 of the bytes read from the start (the reads followed each other)."""
        assert self.hash is not None, "a seek went elsewhere: the bytes read are not the file's start"
        return self.hash.hexdigest()

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 2 and not self.remote.sized:
            raise DataError(f"data.files: {self.remote}: its server gives no size (no Content-Length), which reading "
                            f"this file needs (a parquet file is read from its end)")
        base = {0: 0, 1: self.position, 2: self.remote.size}[whence]
        if base + offset != self.position:
            self.hash = None  # the reads no longer follow each other from the start
        self.position = max(0, base + offset)
        self.file.seek(self.position)  # fsspec's files only move their position here: no request
        return self.position

    def tell(self) -> int:
        return self.position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.file.close()
            self._record()

    def _record(self) -> None:
        """Keep what this read found of the file's start, where it got further than the earlier ones (whose
        bytes it matched on the way), for later reads to be checked against."""
        seen = self.remote.seen
        if self.hash is not None and not self.changed and (self.position, self.ended) > (seen.length, seen.ended):
            seen.length, seen.digest, seen.ended = self.position, self.digest(), self.ended

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, exc_type, *_exc_info) -> None:
        try:
            if exc_type is None and not self.closed:  # read to its end (or as far as asked): the bytes were the listed
                self.verify()
        finally:
            self.close()


def _call(url: str, action: Callable[..., T], *args, before_retry: Callable[[], None] | None = None, **kwargs) -> T:
    """action(*args, **kwargs), retried after before_retry() on a transient error; a DataError line naming url
    otherwise."""
    for attempt in range(RETRIES + 1):
        try:
            return action(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - classified here; anything else becomes one DataError line
            if attempt == RETRIES or not is_transient(err):
                raise remote_error(url, err, retried=attempt) from None
        time.sleep(RETRY_DELAY_S * 2**attempt)
        if before_retry is not None:
            before_retry()
    raise AssertionError("unreachable: the last attempt returns or raises")


def _causes(err: BaseException) -> list[BaseException]:
    """err and the errors it came from (a library's own error often wraps the network's)."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _status(err: BaseException) -> int | None:
    """The HTTP status of an error response (aiohttp's, or botocore's), None for other errors."""
    status = getattr(err, "status", None)
    response = getattr(err, "response", None)
    if status is None and isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _code(err: BaseException) -> str:
    response = getattr(err, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def is_transient(err: BaseException) -> bool:
    """A network error that may pass: a connection refused, reset or timed out, HTTP 5xx or 429, throttling."""
    return _transient_cause(err) is not None


def _transient_cause(err: BaseException) -> BaseException | None:
    """The network error that may pass among err and its causes, or None."""
    for cause in _causes(err):
        names = {kind.__name__ for kind in type(cause).__mro__}
        status = _status(cause)
        if (isinstance(cause, (TimeoutError, ConnectionError)) or names & _TRANSIENT_TYPES
                or (status is not None and (status >= 500 or status == 429)) or _code(cause) in _TRANSIENT_CODES
                or (type(cause) is OSError and cause.errno in (errno.EBUSY, errno.EREMOTEIO))):  # s3fs's 5xx
            return cause
    return None


def remote_error(url: str, err: BaseException, *, retried: int = 0) -> DataError:
    """One line naming the URL and what went wrong, with what to do where that is known."""
    scheme = scheme_of(url) or ""
    where = f"data.files: {display(url)}"
    causes = _causes(err)
    names = {kind.__name__ for cause in causes for kind in type(cause).__mro__}
    statuses = [status for cause in causes if (status := _status(cause)) is not None]
    if names & _CREDENTIAL_TYPES:
        return DataError(f"{where}: no credentials found; set {CREDENTIALS_HELP.get(scheme, 'the credentials')}")
    if isinstance(err, PermissionError) or any(status in (401, 403) for status in statuses):
        message = _message(err, url)
        detail = "" if "://" in message or message.startswith("HTTP ") else f": {message}"
        help = f"; the credentials come from {CREDENTIALS_HELP[scheme]}" if scheme in CREDENTIALS_HELP else ""
        return DataError(f"{where}: access denied (HTTP 403{detail}){help}")
    network = _transient_cause(err)
    # fsspec's HTTP filesystem raises FileNotFoundError for any failed request, a refused connection included.
    if 404 in statuses or (isinstance(err, FileNotFoundError) and network is None):
        return DataError(f"{where}: not found")
    if retried and network is not None:
        return DataError(f"{where}: {_message(network, url)} (a network error, still there after {retried} retries)")
    return DataError(f"{where}: {_message(err, url)}")


def _message(err: BaseException, url: str) -> str:
    """What went wrong, in one line: never a response's body, nor what of url display() leaves out."""
    names = {kind.__name__ for cause in _causes(err) for kind in type(cause).__mro__}
    if "HttpProcessingError" in names:  # aiohttp's parser: its message quotes the bytes it could not parse
        malformed = next(cause for cause in _causes(err) if "HttpProcessingError" in
                         {kind.__name__ for kind in type(cause).__mro__})
        first = str(getattr(malformed, "message", "") or type(malformed).__name__).strip().splitlines()[0]
        return f"a malformed HTTP response ({_one_line(first, url).rstrip(':')})"
    if isinstance(err, TimeoutError) or names & _TIMEOUT_TYPES:
        detail = _one_line(str(err), url)
        return f"no answer within data.remote_timeout_s{f' ({detail})' if detail else ''}"
    status = getattr(err, "status", None)
    if isinstance(status, int):  # aiohttp's message repeats the URL, query string and all
        return f"HTTP {status} {_one_line(str(getattr(err, 'message', '')), url)}".strip()
    text = (err.args[0] if isinstance(err, OSError) and err.args and isinstance(err.args[0], str) else str(err))
    return _one_line(text, url) or type(err).__name__


def _one_line(text: str, url: str) -> str:
    """A library's error text as one printable line of at most MESSAGE_CHARS, without the secrets of url (nor of
    any URL in it) and without quoted bytes, which would be a response's body."""
    for secret in _secrets(url):
        text = text.replace(secret, "...")
    text = scrub(_BYTES_IN_TEXT.sub("...", text))
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def _secrets(url: str) -> list[str]:
    """What of url display() leaves out, which may be credentials: its user and password, query and fragment."""
    rest = url.partition("://")[2]
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    parts = split_url(url)
    user = (parts.netloc if parts is not None else rest[:cut]).rpartition("@")[0]
    after = rest[cut + 1 :]
    found = [user, user.partition(":")[2], after, *after.split("#")]
    return sorted((secret for secret in found if len(secret) >= 4), key=len, reverse=True)
