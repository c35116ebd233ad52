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
NAME=ci-base
. "$(dirname "${BASH_SOURCE[0]}")/ci-lib.sh"
ci_prepare "$TAG" "${1:-}"

work="$(mktemp -d /var/tmp/bwstack-ci-base.XXXXXX)"
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
start=$(date +%s)
ci_debootstrap "$root" "$work" "$CI_PY_LIBS"

# The interpreter, at the same path, on PATH as python3.12 (what the real base's apt python3.12 gives).
ci_copy_python "$root"
chmod 0755 "$root/root"
d="$(dirname "$PY_HOME")"
while [ "$d" != "/root" ] && [ "$d" != "/" ]; do chmod 0755 "$root$d"; d="$(dirname "$d")"; done
ln -sf "$PY_HOME/bin/python3.12" "$root/usr/local/bin/python3.12"
chroot "$root" /usr/local/bin/python3.12 -c 'import ssl'

ci_strip "$root"
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
