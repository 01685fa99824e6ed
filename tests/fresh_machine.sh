#!/bin/sh
# `make test` (the README's set-up command) on a fresh Debian 12: a minbase chroot with nothing but python3,
# git and make (and the CA certificates apt and pip need), its root a mount point as on a real machine,
# the committed tree of this repository copied in. Run by hand, as root, outside CI: it takes minutes
# (debootstrapping, apt-get of APT_PKGS, pip building pyfuse3 from its sdist) and needs Debian's mirrors
# and PyPI. Nothing of the host's is used but the kernel, and, unless FRESH_ROOTFS=1, the Debian minbase
# rootfs the tests run on (bind-mounted read-only, to save a second mmdebstrap).
#
#   tests/fresh_machine.sh                                        # the whole suite
#   PYTEST_ARGS='tests/erofs_builder/test_diff.py' tests/fresh_machine.sh
#
# Everything lives under WORK (default /var/tmp/dsecfs-fresh) and is unmounted whatever happens (the
# binds are slaves: their unmounting never reaches the host's); the chroot stays for a look afterwards
# (rm -rf it when done).
set -eu

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/var/tmp/dsecfs-fresh}
ROOT="$WORK/root"
HOST_ROOTFS=/var/cache/dsecfs-test/debian-minbase
PYTEST_ARGS=${PYTEST_ARGS:-}

cleanup() {
    umount -R "$ROOT" 2>/dev/null || umount -R -l "$ROOT" 2>/dev/null || true
}
trap cleanup EXIT INT TERM
rbind() {  # rbind SOURCE TARGET: SOURCE and the mounts below it; slaves, so no unmount reaches the host's
    mkdir -p "$2"
    mount --rbind "$1" "$2"
    mount --make-rslave "$2"
}

if [ ! -x "$ROOT/usr/bin/python3" ]; then
    rm -rf "$ROOT"
    mkdir -p "$WORK"
    mmdebstrap --quiet --variant=minbase --include=python3,git,make,ca-certificates bookworm "$ROOT"
fi
rm -rf "$ROOT/src"
mkdir -p "$ROOT/src"
git -C "$REPO" archive HEAD | tar -x -C "$ROOT/src"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# A TLS-intercepting proxy between this machine and PyPI: the host trusts its CA, the chroot must too (as
# a machine behind it would be set up to); pip reads the system bundle only when told to.
if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
    chroot "$ROOT" update-ca-certificates >/dev/null
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$ROOT/etc/pip.conf"
fi

rbind "$ROOT" "$ROOT"  # / is a mount point, as on a machine (runc and mount propagation need it)
rbind /proc "$ROOT/proc"
rbind /sys "$ROOT/sys"  # with the cgroup hierarchies below it: runc's limits
rbind /dev "$ROOT/dev"  # /dev/fuse, /dev/pts, /dev/shm
mount -t tmpfs tmpfs "$ROOT/run"  # as on Debian 12; /tmp is on / there
if [ "${FRESH_ROOTFS:-0}" != 1 ] && [ -d "$HOST_ROOTFS" ]; then
    rbind "$HOST_ROOTFS" "$ROOT$HOST_ROOTFS"
    mount -o remount,bind,ro "$ROOT$HOST_ROOTFS"
fi

python=$(chroot "$ROOT" python3 --version)
echo "fresh Debian 12 chroot at $ROOT: $python; running make test PYTEST_ARGS='$PYTEST_ARGS'"
chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    sh -c "cd /src && make test PYTEST_ARGS='$PYTEST_ARGS'"
