"""Crash consistency of publishing: `dsecfs build` killed (SIGKILL) at random points, again and again, into
one store, never leaves a published layer that is incomplete.

Each run builds a source tree of a few MB (hundreds of files, 4 KiB chunks) under a new tag, and kills
the build after a random delay or, on filesystem stores, the moment a chosen object appears (a new pack,
a new pack index, a layer's meta.erofs, its manifest: the points between the steps of the publish order).
Between runs the tree changes a little (files rewritten, added, removed), or not at all, so builds
overlap what earlier ones uploaded. After every run the store must hold:
- every pack index next to its pack, and every pack whole (its id is its sha256, its embedded index reads);
- for every manifest, a complete layer: fsck_layer with check_chunks passes (meta.erofs, blob map and
  every chunk, fetched and re-hashed) and its build info decodes;
- every ref pointing at such a layer.
A build that was not killed must have succeeded, and at the end an uninterrupted build of the last tree
succeeds, reuses what the killed builds uploaded, and a second one uploads nothing.

Stores: a plain directory, posix:// and (once, fewer runs) s3:// on the moto server.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dsec_fs.digest import sha256, to_hex
from dsec_fs.layer import list_refs
from dsec_fs.pack import index_from_pack
from dsec_fs.store import keys, open_store
from erofs_builder.fsck import fsck_layer
from erofs_builder.incremental import decode_buildinfo

DSECFS = os.path.join(os.path.dirname(sys.executable), "dsecfs")
SEED = int(os.environ.get("DSECFS_CRASH_SEED", "8"))
BUILD_TIMEOUT = 120  # a build that takes this long has hung (on a lock a killed build left, say)
FILE_SIZES = (0, 100, 4096, 5000, 9000, 20_000, 40_000)
# Kill points on a filesystem store: (directory under the store root, file name suffix); None: a delay.
FS_TRIGGERS = (None, None, ("packs", ""), ("index", ""), ("layers", "meta.erofs"), ("layers", "manifest.json"))


def write_random(path: str, rng: random.Random) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(rng.randbytes(rng.choice(FILE_SIZES)))


def make_source(src: str, rng: random.Random, files: int = 600) -> None:
    for i in range(files):
        write_random(os.path.join(src, f"d{i % 20}", f"e{i % 7}", f"f{i}"), rng)


def change_source(src: str, rng: random.Random, generation: int) -> None:
    """Rewrite a tenth of the files, add a directory of new ones, delete a few."""
    paths = sorted(os.path.join(d, name) for d, _dirs, names in os.walk(src) for name in names)
    for path in rng.sample(paths, len(paths) // 10):
        write_random(path, rng)
    for i in range(30):
        write_random(os.path.join(src, f"gen{generation}", f"n{i}"), rng)
    for path in rng.sample(paths, 10):
        if os.path.exists(path):
            os.unlink(path)


def start_build(src: str, url: str, ref: str) -> subprocess.Popen:
    return subprocess.Popen([DSECFS, "build", src, "--store", url, "--name", ref, "--chunk-size", "4KiB", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))


def finish(proc: subprocess.Popen) -> tuple[int, bytes, bytes]:
    try:
        out, err = proc.communicate(timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"build {proc.args} ran longer than {BUILD_TIMEOUT} s")
    return proc.returncode, out, err


def build(src: str, url: str, ref: str) -> dict:
    code, out, err = finish(start_build(src, url, ref))
    assert code == 0, err.decode(errors="replace")
    return json.loads(out)


def files_under(root: str, top: str, suffix: str) -> set[str]:
    found = set()
    for directory, _dirs, names in os.walk(os.path.join(root, top)):
        found.update(os.path.join(directory, name) for name in names if name.endswith(suffix)
                     and not name.startswith(".tmp-"))
    return found


def kill_when_written(proc: subprocess.Popen, root: str, top: str, suffix: str, before: set[str]) -> None:
    """SIGKILL ``proc`` as soon as a new object under ``top`` ending in ``suffix`` is in the store."""
    deadline = time.monotonic() + BUILD_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        if files_under(root, top, suffix) - before:
            proc.send_signal(signal.SIGKILL)
            return
        time.sleep(0.0005)


def killed_build(src: str, url: str, ref: str, rng: random.Random, delay_max: float, store_root: str | None) -> bool:
    """One build killed at a random point; True if the kill landed (False: it finished first, and then it
    must have succeeded)."""
    trigger = rng.choice(FS_TRIGGERS) if store_root else None
    before = files_under(store_root, *trigger) if trigger else set()
    proc = start_build(src, url, ref)
    if trigger:
        kill_when_written(proc, store_root, *trigger, before)
    else:
        try:
            proc.wait(timeout=rng.uniform(0, delay_max))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    code, _out, err = finish(proc)
    assert code in (0, -signal.SIGKILL), f"build {ref} failed: {err.decode(errors='replace')}"
    return code == -signal.SIGKILL


def check_store(store, checked: set[str]) -> None:
    """Everything published is complete. Packs and layers are immutable: each is checked once, when first
    seen (``checked`` holds their keys and digests)."""
    for key in store.list(keys.INDEX):
        assert store.exists(keys.pack(keys.id_from_key(key))), f"{key} names a pack the store does not hold"
    for key in sorted(set(store.list(keys.PACKS)) - checked):
        data = store.get(key)
        assert to_hex(sha256(data)) == keys.id_from_key(key), f"{key} is torn"
        index_from_pack(data, source=key)
        checked.add(key)
    published = {key.split("/")[1] for key in store.list(keys.LAYERS) if key.endswith("/manifest.json")}
    for digest in sorted(published - checked):
        report = fsck_layer(store, digest, check_chunks=True)
        assert report.ok, report.summary()
        decode_buildinfo(store.get(keys.layer_buildinfo(digest)), layer=digest, source=digest)
        checked.add(digest)
    for ref, digest in list_refs(store).items():
        assert digest in published, f"ref {ref} points at {digest}, which has no manifest"


def crash_builds(url: str, tmp_path, *, runs: int, store_root: str | None) -> None:
    rng = random.Random(SEED)
    src = str(tmp_path / "src")
    make_source(src, rng)
    started = time.monotonic()  # how long a whole build takes here: the range of random delays
    build(src, url + "-calibration" if url.startswith("s3://") else str(tmp_path / "calibration"), "t/cal:1")
    delay_max = 1.3 * (time.monotonic() - started)

    store = open_store(url, create=True)  # the builds below may be killed before one creates it
    checked: set[str] = set()
    kills = 0
    for run in range(runs):
        if rng.random() < 0.75:  # else: the same tree again, fully overlapping the previous build
            change_source(src, rng, run)
        kills += killed_build(src, url, f"t/x:{run}", rng, delay_max, store_root)
        check_store(store, checked)
    assert kills >= runs // 4, f"only {kills} of {runs} builds were killed before they finished"

    final = build(src, url, "t/x:final")
    check_store(store, checked)
    assert final["stats"]["dedup_bytes"] > 0, "the final build reused nothing the killed builds uploaded"
    again = build(src, url, "t/x:again")
    assert again["layer"] == final["layer"] and again["stats"]["new_chunks"] == 0
    check_store(store, checked)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["path", "posix"])
def test_killed_builds_leave_only_complete_layers(tmp_path, scheme):
    root = str(tmp_path / "store")
    url = root if scheme == "path" else f"posix://{root}"
    crash_builds(url, tmp_path, runs=20, store_root=root)


@pytest.mark.slow
@pytest.mark.s3
def test_killed_builds_leave_only_complete_layers_on_s3(tmp_path, s3_url):
    crash_builds(s3_url, tmp_path, runs=10, store_root=None)
