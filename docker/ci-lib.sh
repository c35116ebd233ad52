# Shared by the TEST FIXTURE image scripts (ci-base.sh, ci-node.sh): sourced, not run. Each step is the one both
# images take: find this host's pyenv CPython 3.12, reuse an existing image, debootstrap Debian 12 minbase, copy
# the interpreter in at the same path (a --enable-shared build whose RUNPATH names its own lib directory) and prove
# it runs there, then strip apt's caches. NAME (set by the caller) prefixes every message.

# The shared libraries the copied interpreter's extension modules link (ssl, ctypes, sqlite3, lzma, bz2,
# readline, curses, uuid, dbm, crypt, nis), beyond what minbase already has.
CI_PY_LIBS=libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libreadline8,libncursesw6,libtinfo6,libexpat1,libuuid1,libcrypt1,libnsl2,libtirpc3,libgdbm6
CI_MIRROR="${BWSTACK_CI_MIRROR:-http://deb.debian.org/debian}"

# Prints TAG and exits when an image with it exists and --rebuild was not given; else checks what a build needs
# and sets PY_HOME.
ci_prepare() {
    local tag="$1" flag="${2:-}"
    PY_HOME="${BWSTACK_CI_PYTHON_HOME:-}"
    if [ -z "$PY_HOME" ]; then
        PY_HOME="$(ls -d /root/.pyenv/versions/3.12.* 2>/dev/null | sort -V | tail -n 1 || true)"
    fi
    if [ "$flag" != "--rebuild" ] && docker image inspect "$tag" >/dev/null 2>&1; then
        echo "$tag (reused)" >&2
        echo "$tag"
        exit 0
    fi
    if [ -z "$PY_HOME" ] || [ ! -x "$PY_HOME/bin/python3.12" ]; then
        echo "$NAME: no CPython 3.12 at ${PY_HOME:-/root/.pyenv/versions/3.12.*} (set BWSTACK_CI_PYTHON_HOME)" >&2
        exit 2
    fi
    command -v debootstrap >/dev/null || { echo "$NAME: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 2; }
}

# ci_debootstrap ROOT WORK INCLUDE: Debian 12 minbase with INCLUDE (comma-separated packages) into ROOT.
ci_debootstrap() {
    local root="$1" work="$2" include="$3"
    debootstrap --variant=minbase --include="$include" bookworm "$root" "$CI_MIRROR" >"$work/debootstrap.log" 2>&1 || {
        tail -n 30 "$work/debootstrap.log" >&2
        exit 1
    }
}

# ci_copy_python ROOT [TAR OPTIONS...]: the interpreter at the same path, site-packages empty as a distribution's
# is; then every library it and its extension modules link must resolve in ROOT, and its stdlib must import.
ci_copy_python() {
    local root="$1"
    shift
    local rel="${PY_HOME#/}"
    local lib="$rel/lib/python3.12"
    tar -C / \
        --exclude="$lib/test" --exclude="$lib/idlelib" --exclude="$lib/tkinter" --exclude="$lib/turtledemo" \
        --exclude="$lib/lib-dynload/_tkinter*" --exclude="$lib/site-packages/*" --exclude="$rel/bin/pip*" \
        --exclude="$rel/bin/idle*" "$@" -cf - "$rel" | tar -C "$root" -xf -
    local missing
    missing="$(chroot "$root" /bin/sh -c "ldd $PY_HOME/bin/python3.12 $PY_HOME/lib/python3.12/lib-dynload/*.so" | grep 'not found' || true)"
    if [ -n "$missing" ]; then
        echo "$NAME: libraries missing in the image: $missing" >&2
        exit 1
    fi
    chroot "$root" "$PY_HOME/bin/python3.12" -c 'import ssl, ctypes, sqlite3, lzma, bz2, zlib, uuid, venv, ensurepip'
}

# ci_strip ROOT: no apt lists, package caches or temporary files in the image.
ci_strip() {
    rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/cache/apt/archives/*.deb "$1"/tmp/*
}
