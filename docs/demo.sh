#!/bin/sh
# The README's `make demo`: the whole system on the embedded default (a local directory store), as root.
#
#   image CI   build a Debian minbase rootfs and a toolkit into layers, check them
#   a node     `sandbox up` starts the node daemon, which mounts the layers lazily (kernel EROFS over
#              chunks fetched on demand) and stacks them with OverlayFS; commands run in the sandbox
#              with runc; the daemon shows how much of each layer was fetched
#   stop       the sandbox goes down, the daemon stops (unmounting everything), and the access traces it
#              wrote become a report (report.html, report.json)
#   export     the layer is a plain EROFS image: mounted by the kernel without dsecfs
#
# The node's socket, state and cache directories are set once, in the environment (DSECFS_SOCKET,
# DSECFS_STATE_DIR, DSECFS_CACHE_DIR), and every command follows them. Everything but the store is
# under DEMO_DIR; whatever happens, the daemon is stopped and nothing stays mounted.
set -eu

DSECFS=${DSECFS:-dsecfs}
PYTHON=${PYTHON:-python3}
ROOTFS=${ROOTFS:-/var/cache/dsecfs-test/debian-minbase}
DEMO_DIR=${DEMO_DIR:-/tmp/dsecfs-demo}
export DSECFS_STORE=${STORE:-/var/lib/dsecfs/store}
export DSECFS_SOCKET="$DEMO_DIR/daemon.sock"
export DSECFS_STATE_DIR="$DEMO_DIR/state"
export DSECFS_CACHE_DIR="$DEMO_DIR/cache"

step() { printf '\n== %s\n' "$*"; }

stop_daemon() {
    "$DSECFS" status -q 2>/dev/null || return 0  # none answers
    pid=$("$DSECFS" status --json | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["pid"])')
    kill -TERM "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
}

cleanup() {
    [ -n "${sandbox:-}" ] && "$DSECFS" sandbox down "$sandbox" -q 2>/dev/null || true
    stop_daemon
}

stop_daemon  # a daemon left by an earlier run of the demo
rm -rf "$DEMO_DIR"
mkdir -p "$DEMO_DIR"

step "image CI: the Debian base layer and a toolkit layer"
"$DSECFS" build "$ROOTFS" --name base/debian:12
toolkit="$DEMO_DIR/toolkit/opt/toolkit"
mkdir -p "$toolkit/bin" "$toolkit/share"
cp -r "$("$PYTHON" -c 'import click, os; print(os.path.dirname(click.__file__))')" "$toolkit/share/"
cat > "$toolkit/bin/toolkit-info" <<'EOF'
#!/bin/sh
set -e
files=$(find /opt/toolkit/share -name '*.py' | wc -l)
lines=$(find /opt/toolkit/share -name '*.py' -exec cat {} + | wc -l)
echo "toolkit: $files Python files, $lines lines in /opt/toolkit/share"
EOF
chmod 755 "$toolkit/bin/toolkit-info"
"$DSECFS" build "$DEMO_DIR/toolkit" --name tk/demo:1
"$DSECFS" ref ls
"$DSECFS" inspect base/debian:12
"$DSECFS" fsck base/debian:12

step "a node: sandbox up starts the daemon, which mounts the layers lazily"
trap cleanup EXIT
sandbox=$("$DSECFS" sandbox up --base base/debian:12 --toolkit tk/demo:1 -q)
echo "sandbox $sandbox"
"$DSECFS" sandbox exec "$sandbox" /bin/sh -c '. /etc/os-release; echo "$PRETTY_NAME: $(dpkg-query -W | wc -l) packages"'
"$DSECFS" sandbox exec "$sandbox" /opt/toolkit/bin/toolkit-info
"$DSECFS" status

step "stop: the sandbox goes down, the daemon stops, its traces become a report"
"$DSECFS" sandbox down "$sandbox"
sandbox=
stop_daemon
trap - EXIT
"$DSECFS" trace report "$DSECFS_STATE_DIR/traces" -o "$DEMO_DIR/report"

step "export: the layer is a plain EROFS image the kernel mounts without dsecfs"
"$DSECFS" export base/debian:12 "$DEMO_DIR/export"
mkdir -p "$DEMO_DIR/mnt"
"$DSECFS" mount-export "$DEMO_DIR/export" "$DEMO_DIR/mnt" -- \
    chroot "$DEMO_DIR/mnt" /usr/bin/dpkg-query -W -f '${Package}\n' | wc -l
