"""A small client for PEP 691 simple indexes (PyPI and mirrors) and for wheel metadata over HTTP ranges."""

from __future__ import annotations

import email.parser
import re
import struct
import zlib
from dataclasses import dataclass
from datetime import datetime
from html.parser import HTMLParser
from typing import TYPE_CHECKING
from urllib.parse import unquote, urljoin, urlsplit

from packaging.utils import canonicalize_name

from bwstack.errors import BwstackError

if TYPE_CHECKING:  # requests (and urllib3, http.cookiejar, charset_normalizer) is imported when a session is
    import requests  # made: a command that downloads nothing starts ~0.2 s sooner without it

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
TIMEOUT = (15, 120)


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    upload_time: datetime | None
    yanked: bool


def session() -> requests.Session:
    """One HTTP session; TLS is always verified (REQUESTS_CA_BUNDLE / --ca-bundle pick the CA)."""
    import requests

    s = requests.Session()
    s.headers["User-Agent"] = "bwstack (+https://github.com/) requests"
    adapter = requests.adapters.HTTPAdapter(pool_connections=32, pool_maxsize=32, max_retries=3)
    s.mount("https://", adapter)
    return s


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            attributes = dict(attrs)
            if attributes.get("href"):
                self.links.append((attributes["href"] or "", attributes))


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def project_files(http: requests.Session, index_url: str, project: str) -> list[IndexFile]:
    """Files an index lists for a project (JSON form when offered, else PEP 503 HTML)."""
    import requests

    url = f"{index_url.rstrip('/')}/{canonicalize_name(project)}/"
    try:
        response = http.get(url, headers={"Accept": f"{SIMPLE_JSON}, text/html;q=0.1"}, timeout=TIMEOUT)
    except requests.RequestException as exc:
        raise BwstackError(f"cannot reach {url}: {_reason(exc)}") from None
    if response.status_code == 404:
        raise BwstackError(f"{project}: not found on {index_url}")
    if not response.ok:
        raise BwstackError(f"{url}: HTTP {response.status_code}")
    if response.headers.get("Content-Type", "").startswith(SIMPLE_JSON):
        out = []
        for item in response.json()["files"]:
            out.append(
                IndexFile(
                    filename=item["filename"],
                    url=urljoin(url, item["url"]),
                    sha256=item.get("hashes", {}).get("sha256"),
                    upload_time=_parse_time(item.get("upload-time")),
                    yanked=bool(item.get("yanked")),
                )
            )
        return out
    parser = _Anchors()
    parser.feed(response.text)
    out = []
    for href, attrs in parser.links:
        full = urljoin(url, href)
        path, _, fragment = full.partition("#")
        sha = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
        filename = urlsplit(path).path.rsplit("/", 1)[-1]
        filename = unquote(filename)
        out.append(IndexFile(filename, path, sha, None, attrs.get("data-yanked") is not None))
    return out


def _reason(exc: Exception) -> str:
    text = str(exc)
    match = re.search(r"(Name or service not known|Connection refused|timed out|CERTIFICATE_VERIFY_FAILED[^']*)", text)
    return match.group(1) if match else text.splitlines()[0][:200]


def wheel_metadata(http: requests.Session, url: str) -> str:
    """The METADATA text of a remote wheel: the PEP 658 file when served, else read through HTTP ranges."""
    response = http.get(url + ".metadata", timeout=TIMEOUT)
    if response.ok and response.text.startswith("Metadata-Version"):
        return response.text
    return _metadata_by_range(http, url)


def _range(http: requests.Session, url: str, spec: str) -> bytes:
    response = http.get(url, headers={"Range": f"bytes={spec}"}, timeout=TIMEOUT)
    if response.status_code != 206:
        raise BwstackError(f"{url}: the server does not answer range requests (HTTP {response.status_code})")
    return response.content


def _metadata_by_range(http: requests.Session, url: str) -> str:
    tail = _range(http, url, "-65536")
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise BwstackError(f"{url}: no zip directory in the last 64 KiB (zip64 wheels are not supported here)")
    cd_size, cd_offset = struct.unpack_from("<II", tail, eocd + 12)
    directory = _range(http, url, f"{cd_offset}-{cd_offset + cd_size - 1}")
    pos = 0
    while pos + 46 <= len(directory) and directory[pos : pos + 4] == b"PK\x01\x02":
        (method,) = struct.unpack_from("<H", directory, pos + 10)
        csize, _usize, nlen, elen, clen = struct.unpack_from("<IIHHH", directory, pos + 20)
        (local_offset,) = struct.unpack_from("<I", directory, pos + 42)
        name = directory[pos + 46 : pos + 46 + nlen].decode()
        pos += 46 + nlen + elen + clen
        if re.fullmatch(r"[^/]+\.dist-info/METADATA", name):
            header = _range(http, url, f"{local_offset}-{local_offset + 29}")
            lnlen, lelen = struct.unpack_from("<HH", header, 26)
            start = local_offset + 30 + lnlen + lelen
            data = _range(http, url, f"{start}-{start + csize - 1}")
            if method == 8:
                data = zlib.decompress(data, -15)
            return data.decode("utf-8")
    raise BwstackError(f"{url}: no .dist-info/METADATA in the wheel")


def requires_dist(metadata_text: str) -> list[str]:
    message = email.parser.Parser().parsestr(metadata_text, headersonly=True)
    return [line.strip() for line in message.get_all("Requires-Dist") or []]


def provides_extras(metadata_text: str) -> set[str]:
    message = email.parser.Parser().parsestr(metadata_text, headersonly=True)
    return {line.strip() for line in message.get_all("Provides-Extra") or []}
