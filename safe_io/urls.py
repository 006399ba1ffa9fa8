"""URLs as a message, a log or a record shows them: without a user, password, query string or fragment, which may
be credentials (a presigned URL's signature, a tracking server's password)."""
from __future__ import annotations

import re
from typing import Any
from urllib.parse import SplitResult, urlsplit

# Object stores: their URLs name a bucket, whose name never holds ':'.
STORE_SCHEMES = ("s3", "gs", "gcs")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://[^\s'\"<>]+")


def scheme_of(entry: str) -> str | None:
    """The URL scheme of an entry ("s3", "https", ...), None for a local path."""
    match = _SCHEME.match(entry)
    return match.group(1).lower() if match else None


def is_url(entry: str) -> bool:
    return scheme_of(entry) is not None


def display(url: str) -> str:
    """The URL without what may be a secret: a user, password, query string or fragment. A URL whose host does
    not parse (a password holding an unescaped '/', say) is shown from the last '@' before its query on."""
    if not is_url(url):
        return url
    parts = split_url(url)
    if parts is None:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{re.split(r'[?#]', rest, maxsplit=1)[0].rpartition('@')[2]}"
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"  # the host as written


def split_url(url: str) -> SplitResult | None:
    """The URL's parts, or None where its host or port does not parse (or, in a store's URL, holds the ':' that
    no bucket name has: what precedes it may be a key and secret)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number from 0 to 65535
    except ValueError:
        return None
    if parts.scheme in STORE_SCHEMES and ":" in parts.netloc.rpartition("@")[2]:
        return None
    return parts


def scrub(text: str) -> str:
    """text with every URL in it as display() shows it."""
    return _URL_IN_TEXT.sub(lambda match: display(match.group(0)), text)


def without_credentials(value: Any) -> Any:
    """Plain data (dicts, lists, strings, ...) with every string that is a URL as display() shows it: no user,
    password, query string or fragment."""
    if isinstance(value, dict):
        return {key: without_credentials(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(without_credentials(item) for item in value)
    return display(value) if isinstance(value, str) else value
