"""Searching an image for what must never be in it: a CA or a secret in its history, a copy of a CA in a layer.

Used by the image checks (tests/infra/test_image.py, run by `bwstack image verify`) and by the tests.
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from collections.abc import Iterable, Iterator


def history_problems(history: list[dict]) -> list[str]:
    """What in an image's history looks like a CA, a key or a secret put into a layer or a build arg."""
    problems = []
    for entry in history:
        created_by = entry.get("CreatedBy") or ""
        if re.search(r"-----BEGIN [A-Z ]*(CERTIFICATE|PRIVATE KEY)", created_by):
            problems.append(f"PEM material in: {created_by[:120]}")
        if re.search(r"(ADD|COPY) .*\.(pem|crt|key|p12)\b", created_by, re.IGNORECASE):
            problems.append(f"a certificate or key file is copied in: {created_by[:160]}")
        if re.search(r"\b(SSL_CERT_FILE|REQUESTS_CA_BUNDLE|PIP_CERT|CURL_CA_BUNDLE)=", created_by):
            problems.append(f"a CA bundle setting is baked in: {created_by[:160]}")
        if re.search(r"_proxy=\S*://[^\s/@]*:[^\s/@]*@", created_by, re.IGNORECASE):
            problems.append("a proxy URL with credentials (e.g. a build token) is in the history")
    return problems


class _StreamReader(io.RawIOBase):
    """A file object over docker-py's chunk generator (for streaming `docker save` through tarfile)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(target), len(self._buffer))
        target[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n


class _HashingReader(io.RawIOBase):
    """Reads through a file object, hashing what passes (a saved layer's sha256 is its diff id)."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self.digest = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        data = self._raw.read(len(target))
        self.digest.update(data)
        target[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while data := self._raw.read(1 << 20):
            self.digest.update(data)


def pem_needles(pem_text: str) -> list[bytes]:
    """One distinctive base64 line from each certificate in a PEM bundle (what a copy of it would contain)."""
    needles = []
    for block in re.findall(r"-----BEGIN CERTIFICATE-----\s+(.*?)-----END CERTIFICATE-----", pem_text, re.S):
        lines = [line.strip() for line in block.splitlines() if len(line.strip()) >= 48]
        if lines:
            needles.append(lines[len(lines) // 2].encode())
    return needles


def scan_image(client, image: str, needles: list[bytes], skip_layers: Iterable[str] = ()) -> list[str]:
    """Paths (layer diff id: file) of files in the image's layers that contain any needle; streams
    `docker save`, nothing is written to disk. Layers whose diff id is in skip_layers (the base) are ignored."""
    skip = set(skip_layers)
    hits: list[tuple[str, str]] = []
    if not needles:
        return []
    overlap = max(len(n) for n in needles)
    chunks = client.api.get_image(image)
    with tarfile.open(fileobj=io.BufferedReader(_StreamReader(chunks), 1 << 20), mode="r|") as outer:
        for member in outer:
            if not member.name.endswith("layer.tar"):
                continue
            layer = _HashingReader(outer.extractfile(member))
            layer_hits = []
            with tarfile.open(fileobj=io.BufferedReader(layer, 1 << 20), mode="r|") as inner:
                for item in inner:
                    if not item.isfile():
                        continue
                    handle = inner.extractfile(item)
                    tail = b""
                    while chunk := handle.read(1 << 20):
                        window = tail + chunk
                        if any(n in window for n in needles):
                            layer_hits.append(item.name)
                            break
                        tail = window[-overlap:]
            layer.drain()  # the rest of the layer, for its digest
            diff_id = "sha256:" + layer.digest.hexdigest()
            hits += [(diff_id, name) for name in layer_hits if diff_id not in skip]
    return [f"{d[:19]}: {n}" for d, n in hits]


def scan_for_ca(client, image: str, pem_text: str, base_image: str = "") -> tuple[list[str], int]:
    """(files of the layers the build added that hold a certificate of pem_text, how many were searched for);
    the layers of base_image (the image's base label), when it is here, are not searched."""
    needles = pem_needles(pem_text)
    base_layers: list[str] = []
    if base_image:
        try:
            base_layers = client.images.get(base_image).attrs["RootFS"]["Layers"]
        except Exception:  # not here (docker.errors.ImageNotFound) or no layers: search every layer
            base_layers = []
    return scan_image(client, image, needles, base_layers), len(needles)
