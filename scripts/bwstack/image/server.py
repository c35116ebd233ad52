"""The build server: serves one build's inputs to its RUN steps on the Docker bridge, for the length of that build.

The build's secret. A build arg that changes with every build would, with the classic builder, bust the cache
of every RUN after it and show in `docker history` (`|N ARG=value /bin/sh -c ...`). BuildKit's secret mounts
(`RUN --mount=type=secret`) avoid both, but docker-py cannot drive BuildKit (it has no BuildKit session), the
docker CLI needs the buildx plugin for it since Docker 23 (this project's build host has a CLI without it),
and the classic builder's cache model (intermediate images, --cache-from the previous chain) would have to
be replaced. What both builders do offer are the predefined proxy build args: Docker passes HTTP_PROXY,
http_proxy, HTTPS_PROXY, FTP_PROXY and NO_PROXY (upper and lower case) into every RUN's environment, leaves
them out of the layer cache key and out of `docker history`, by design, because proxy URLs carry credentials
(Dockerfile reference, "Predefined ARGs"; checked on this host's Docker 20.10: two builds with different
tokens share every cached layer, and the history has no trace of it). So the build server is an HTTP proxy
for one name that never resolves, http://bwstack-build.invalid/, and the build reaches it through
`http_proxy=http://bwstack:<token>@<bridge gateway>:<port>`: every RUN fetches from that name, urllib sends
the token as Proxy-Authorization, the server compares it in constant time and refuses anything else (a
missing or wrong token, another host, a plain request) with 403. The token lives for one build (the server
stops when the build ends), never enters a layer, the history or an image's config (the tests search
`docker save` output and every history entry for it), and the address, also in the proxy URL, no longer
needs a fixed port to keep the cache. Consequences: plain-http traffic of any RUN goes to that proxy, which
refuses it; the system stage's apt therefore reaches the distribution's archive through the operator's
HTTP_PROXY if the Docker client sets one, else directly. Whoever can use the Docker socket can read a running
build's environment, and so the token: that is root on the build host, for whom nothing here is secret.
"""

from __future__ import annotations

import base64
import hmac
import http.server
import os
import secrets
import socket
import stat
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bwstack.errors import BwstackError
from bwstack.provision.wheelhouse import file_identity

# The name the build's RUN steps fetch from. `.invalid` never resolves (RFC 6761): only the build's proxy answers.
BUILD_HOST = "bwstack-build.invalid"
PROXY_USER = "bwstack"


@dataclass(frozen=True)
class Pinned:
    """A file as it was when its bytes were checked: served only while the name still leads to that same file
    (device, inode, size, times), so a name swapped after the hash check is refused, not served."""

    path: Path
    identity: tuple[int, int, int, int, int]

    @classmethod
    def of(cls, path: Path, st: os.stat_result) -> Pinned:
        return cls(path, file_identity(st))


def new_build_token() -> str:
    """A fresh per-build secret (256 bits, URL-safe: it sits in the userinfo of a proxy URL)."""
    return secrets.token_urlsafe(32)


class BuildServer:
    """Serves one build's inputs to its RUN steps on the Docker bridge, for the length of that build.

    It is an HTTP proxy for http://bwstack-build.invalid/ only, and answers only requests that carry the build's
    token as `Proxy-Authorization: Basic` (user "bwstack"): a missing or wrong token, a request for any other
    host and a plain (non-proxy) request get 403, counted in `refused`. Only named routes exist: /step.py,
    /tool.tar, /lock.yaml, /ca.pem (when a CA bundle was given) and /wheels/<file> for the wheels the rendered
    requirement files name; anything else is 404.
    """

    def __init__(
        self, host: str, port: int, files: Mapping[str, Path | Pinned], blobs: Mapping[str, bytes], token: str
    ) -> None:
        if not token:
            raise ValueError("the build server needs a token")
        self.host = host
        self.port = port
        self.files = dict(files)
        self.blobs = dict(blobs)
        self.requests = 0
        self.bytes_sent = 0
        self.refused = 0
        self._token = token
        self._expected = "Basic " + base64.b64encode(f"{PROXY_USER}:{token}".encode()).decode()
        self._lock = threading.Lock()
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._held: dict[str, tuple[int, int]] = {}  # route -> (descriptor, size): opened once, in __enter__

    @property
    def url(self) -> str:
        """Where the server listens (no secret in it)."""
        return f"http://{self.host}:{self.port}"

    @property
    def proxy_url(self) -> str:
        """The secret: what the build's RUN steps get as http_proxy (see build_secret_args)."""
        return f"http://{PROXY_USER}:{self._token}@{self.host}:{self.port}"

    def _authorized(self, request: http.server.BaseHTTPRequestHandler) -> tuple[str | None, str]:
        """(the route, "") for a request of this build, else (None, why it is refused)."""
        given = request.headers.get("Proxy-Authorization") or ""
        if not hmac.compare_digest(given.encode(), self._expected.encode()):
            return None, "no valid build token"
        target = urllib.parse.urlsplit(request.path)
        if target.scheme != "http" or target.netloc != BUILD_HOST:
            return None, f"this proxy serves http://{BUILD_HOST}/ only"
        return urllib.parse.unquote(target.path), ""

    def _handler(self):
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, head: bool) -> None:
                route, why = server._authorized(self)
                if route is None:
                    with server._lock:
                        server.refused += 1
                    self.send_error(403, f"refused by bwstack image build: {why}")
                    return
                blob = server.blobs.get(route)
                held = server._held.get(route)
                if blob is None and held is None:
                    self.send_error(404, "not served by bwstack image build")
                    return
                size = len(blob) if blob is not None else held[1]
                if not head:
                    with server._lock:  # counted before the answer, so a client that has it sees the count
                        server.requests += 1
                        server.bytes_sent += size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if head:
                    return
                if blob is not None:
                    self.wfile.write(blob)
                else:
                    self.wfile.flush()
                    _send(self.connection, *held)

        return Handler

    def _hold(self) -> None:
        """Every file served opened once, now, before the build asks for any: a regular file (not a FIFO that
        would hang a request, not a device), and for a pinned one the very file that was checked."""
        for route, value in self.files.items():
            path = value.path if isinstance(value, Pinned) else value
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                raise BwstackError(f"cannot serve {path} to the build: {exc.strerror}") from None
            st = os.fstat(fd)
            self._held[route] = (fd, st.st_size)
            if not stat.S_ISREG(st.st_mode):
                raise BwstackError(f"cannot serve {path} to the build: not a regular file")
            if isinstance(value, Pinned) and file_identity(st) != value.identity:
                raise BwstackError(
                    f"{path} changed after it was hash-checked (another file is at that name now): refused; "
                    "run the build again"
                )

    def _let_go(self) -> None:
        for fd, _ in self._held.values():
            os.close(fd)
        self._held.clear()

    def __enter__(self) -> BuildServer:
        try:
            self._hold()
        except BaseException:
            self._let_go()
            raise
        try:
            self._httpd = http.server.ThreadingHTTPServer((self.host, self.port), self._handler())
        except OSError as exc:
            self._let_go()
            raise BwstackError(
                f"cannot serve the build on {self.host}:{self.port} ({exc.strerror}): the port is taken, or the "
                "Docker daemon is not on this host; pass another --build-port (0: any free port)"
            ) from None
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="bwstack-build-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        self._let_go()


def _send(connection: socket.socket, fd: int, size: int) -> None:
    """size bytes of fd from its start, by offset (each request its own position: requests run in threads)."""
    offset = 0
    try:
        while offset < size:
            sent = os.sendfile(connection.fileno(), fd, offset, size - offset)
            if sent == 0:  # the file shrank since it was opened: the step's hash check refuses what it got
                break
            offset += sent
    except (BrokenPipeError, ConnectionResetError):
        pass  # the step went away (a failed RUN): its own error is what the build reports


def build_secret_args(server: BuildServer) -> dict[str, str]:
    """The build args that carry the secret: only `http_proxy`, which Docker passes to every RUN but keeps out
    of the cache key and `docker history` (it is a predefined proxy arg, and the Dockerfile must never declare
    it with ARG, which would put it in both). Never logged, never returned."""
    return {"http_proxy": server.proxy_url}
