#!/usr/bin/env bash
# TEST FIXTURE: a minimal remote node for bwstack's SSH tests, made without any registry.
#
#   docker/ci-node.sh [--rebuild]      -> prints the tag (default bwstack-ci-node:bookworm)
#
# What an operator's fresh Debian 12 server has: `debootstrap --variant=minbase` plus openssh-server, python3
# (Debian's 3.11, the interpreter Ansible discovers) and ca-certificates, with the site's CA installed the
# Debian way (/usr/local/share/ca-certificates + update-ca-certificates). The site's CA is what this machine's
# bundle (/etc/ssl/certs/ca-certificates.crt) holds beyond Debian's own list: here, the TLS-intercepting
# proxy's CA. Nothing else: no sudo, no pip, no python3-venv, no setuptools or packaging, no systemd.
#
# One addition the bwstack profiles force: they pin Python 3.12 and Debian 12 ships 3.11. Like docker/ci-base.sh,
# this host's pyenv CPython 3.12 is copied in AT THE SAME PATH (a --enable-shared build whose RUNPATH names its
# own lib directory), as an operator who installed it with pyenv for root would have it: not on PATH, not
# python3, so Ansible's interpreter discovery finds Debian's python3 (3.11) and only bwstack's interpreter
# search (~/.pyenv/versions/3.12.*) finds 3.12. It stands in for Ubuntu 24.04's apt python3.12.
#
# Containers start sshd in the foreground with host keys made at start (each container its own); the test
# adds its client key and reads the host key for its known-hosts file. Root logs in with a key only.
#
# Idempotent: an existing image with the tag is reused unless --rebuild is given.
# Needs: root, debootstrap, a running Docker daemon, Debian's archive (http) reachable.
set -euo pipefail

TAG="${BWSTACK_CI_NODE_TAG:-bwstack-ci-node:bookworm}"
HOST_BUNDLE="${BWSTACK_CI_HOST_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
NAME=ci-node
. "$(dirname "${BASH_SOURCE[0]}")/ci-lib.sh"
ci_prepare "$TAG" "${1:-}"

# The node's own packages (the copied interpreter's libraries come with them).
PACKAGES=openssh-server,python3,ca-certificates

work="$(mktemp -d /var/tmp/bwstack-ci-node.XXXXXX)"
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"
start=$(date +%s)
ci_debootstrap "$root" "$work" "$PACKAGES,$CI_PY_LIBS"

# The site's CA: every certificate of this machine's bundle that Debian's own bundle lacks.
python3 - "$HOST_BUNDLE" "$root/etc/ssl/certs/ca-certificates.crt" "$root/usr/local/share/ca-certificates" <<'EOF'
import re, sys
pem = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)
host, node, out = sys.argv[1:]
known = {c.strip() for c in pem.findall(open(node).read())}
extra = [c for c in pem.findall(open(host).read()) if c.strip() not in known]
for i, cert in enumerate(extra):  # one certificate per file, as update-ca-certificates wants
    open(f"{out}/bwstack-ci-site-ca-{i}.crt", "w").write(cert + "\n")
print(f"ci-node: {len(extra)} site CA certificate(s) from {host}", file=sys.stderr)
EOF
chroot "$root" update-ca-certificates >/dev/null

# The profile's interpreter (see above), at the same path, not as python3 or python.
ci_copy_python "$root" --exclude="${PY_HOME#/}/bin/python3" --exclude="${PY_HOME#/}/bin/python"
case "$PY_HOME" in
    /root/.pyenv/versions/3.12.*) ;;  # where bwstack's interpreter search looks
    *) ln -sf "$PY_HOME/bin/python3.12" "$root/usr/local/bin/python3.12" ;;  # elsewhere: on PATH instead
esac
# What the node must NOT have (the tests rely on a bare node): pip, venv support, setuptools, packaging, sudo.
for absent in /usr/bin/pip3 /usr/bin/sudo /usr/lib/python3/dist-packages/setuptools /usr/lib/python3/dist-packages/packaging; do
    if [ -e "$root$absent" ]; then echo "ci-node: $absent is in the image; the node must be bare" >&2; exit 1; fi
done
if chroot "$root" /usr/bin/python3 -c 'import ensurepip' 2>/dev/null; then
    echo "ci-node: python3 has ensurepip (python3-venv); the node must be bare" >&2
    exit 1
fi

# sshd: host keys are made when a container starts, never baked into the image.
rm -f "$root"/etc/ssh/ssh_host_*
mkdir -p "$root/root/.ssh"
chmod 0700 "$root/root/.ssh"
cat >"$root/usr/local/sbin/bwstack-ci-node-start" <<'EOF'
#!/bin/sh
# TEST FIXTURE entry point: host keys of this container, then sshd in the foreground (logs on stderr).
set -e
ssh-keygen -A >/dev/null
mkdir -p /run/sshd
exec /usr/sbin/sshd -D -e
EOF
chmod 0755 "$root/usr/local/sbin/bwstack-ci-node-start"

ci_strip "$root"
version="$("$PY_HOME/bin/python3.12" -c 'import platform; print(platform.python_version())')"
tar -C "$root" --numeric-owner -cf - . | docker import \
    --change 'LABEL io.bwstack.test-fixture="true"' \
    --change 'LABEL org.opencontainers.image.title="bwstack CI node (TEST FIXTURE)"' \
    --change "LABEL org.opencontainers.image.description=\"TEST FIXTURE for bwstack's SSH tests: Debian 12 minbase (debootstrap) + openssh-server + python3 + ca-certificates with the site's CA; CPython $version copied from pyenv at $PY_HOME (the profiles' interpreter, not on PATH). Not a serving node.\"" \
    --change 'LABEL org.opencontainers.image.base.name="debian:bookworm (debootstrap --variant=minbase)"' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'EXPOSE 22' \
    --change 'CMD ["/usr/local/sbin/bwstack-ci-node-start"]' \
    - "$TAG" >/dev/null
echo "ci-node: built $TAG in $(( $(date +%s) - start )) s" >&2
echo "$TAG"
