#!/usr/bin/env bash
# TEST FIXTURE: the CI base image bwstack's image tests build on, made without any registry.
#
#   docker/ci-base.sh [--rebuild]      -> prints the tag (default bwstack-ci-base:bookworm-py312)
#
# Debian 12 minbase from `debootstrap` (~30 s), turned into an image with `docker import`, plus this host's
# pyenv CPython 3.12 copied in AT THE SAME PATH (it is a --enable-shared build whose RUNPATH names its own
# lib directory), linked as /usr/local/bin/python3.12. It stands in for what the real base
# (nvidia/cuda:*-cudnn-devel-ubuntu24.04 + apt python3.12) gives: a python3.12 on PATH. It has NO CUDA
# toolkit, so the image build takes the toolkit from the lock's PyPI wheels (`bwstack cuda install`).
# Nothing from the host's Python site-packages is copied (no pip, no .pth hooks), nor the test suite,
# tkinter or IDLE. /root is made world-traversable so the non-root runtime user can run that interpreter:
# a fixture-only concession, named in the image's labels.
#
# Idempotent: an existing image with the tag is reused unless --rebuild is given.
# Needs: root, debootstrap, a running Docker daemon, Debian's archive (http) reachable.
set -euo pipefail

TAG="${BWSTACK_CI_BASE_TAG:-bwstack-ci-base:bookworm-py312}"
MIRROR="${BWSTACK_CI_MIRROR:-http://deb.debian.org/debian}"
PY_HOME="${BWSTACK_CI_PYTHON_HOME:-}"
if [ -z "$PY_HOME" ]; then
    PY_HOME="$(ls -d /root/.pyenv/versions/3.12.* 2>/dev/null | sort -V | tail -n 1 || true)"
fi

if [ "${1:-}" != "--rebuild" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG (reused)" >&2
    echo "$TAG"
    exit 0
fi
if [ -z "$PY_HOME" ] || [ ! -x "$PY_HOME/bin/python3.12" ]; then
    echo "ci-base: no CPython 3.12 at ${PY_HOME:-/root/.pyenv/versions/3.12.*} (set BWSTACK_CI_PYTHON_HOME)" >&2
    exit 2
fi
command -v debootstrap >/dev/null || { echo "ci-base: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }

# The shared libraries the interpreter's extension modules link (ssl, ctypes, sqlite3, lzma, bz2, readline,
# curses, uuid, dbm, crypt, nis), beyond what minbase already has.
LIBS=libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libreadline8,libncursesw6,libtinfo6,libexpat1,libuuid1,libcrypt1,libnsl2,libtirpc3,libgdbm6

work="$(mktemp -d /var/tmp/bwstack-ci-base.XXXXXX)"
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
start=$(date +%s)
debootstrap --variant=minbase --include="$LIBS" bookworm "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    exit 1
}

# The interpreter, at the same path. Site-packages stays empty, as a distribution's python3.12 is.
rel="${PY_HOME#/}"
lib="$rel/lib/python3.12"
tar -C / \
    --exclude="$lib/test" --exclude="$lib/idlelib" --exclude="$lib/tkinter" --exclude="$lib/turtledemo" \
    --exclude="$lib/lib-dynload/_tkinter*" --exclude="$lib/site-packages/*" --exclude="$rel/bin/pip*" \
    --exclude="$rel/bin/idle*" -cf - "$rel" | tar -C "$root" -xf -
chmod 0755 "$root/root"
d="$(dirname "$PY_HOME")"
while [ "$d" != "/root" ] && [ "$d" != "/" ]; do chmod 0755 "$root$d"; d="$(dirname "$d")"; done
ln -sf "$PY_HOME/bin/python3.12" "$root/usr/local/bin/python3.12"

missing="$(chroot "$root" /bin/sh -c "ldd $PY_HOME/bin/python3.12 $PY_HOME/lib/python3.12/lib-dynload/*.so" | grep 'not found' || true)"
if [ -n "$missing" ]; then
    echo "ci-base: libraries missing in the image: $missing" >&2
    exit 1
fi
chroot "$root" /usr/local/bin/python3.12 -c 'import ssl, ctypes, sqlite3, lzma, bz2, zlib, uuid, venv, ensurepip'

rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/tmp/*
version="$("$PY_HOME/bin/python3.12" -c 'import platform; print(platform.python_version())')"
tar -C "$root" --numeric-owner -cf - . | docker import \
    --change 'LABEL io.bwstack.test-fixture="true"' \
    --change 'LABEL org.opencontainers.image.title="bwstack CI base (TEST FIXTURE)"' \
    --change "LABEL org.opencontainers.image.description=\"TEST FIXTURE for bwstack's image tests: Debian 12 minbase (debootstrap) + CPython $version copied from pyenv at $PY_HOME, standing in for Ubuntu 24.04's python3.12; no CUDA toolkit; /root is 0755. Not a serving base.\"" \
    --change 'LABEL org.opencontainers.image.base.name="debian:bookworm (debootstrap --variant=minbase)"' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG" >/dev/null
echo "ci-base: built $TAG in $(( $(date +%s) - start )) s" >&2
echo "$TAG"
