"""Store benchmark (issue 3): what a build costs in S3 requests and bytes, and how much related layers share.

Part 1, upload. The cached Debian minbase rootfs is built into an S3 store on a local moto server, side by
side with the plain way of shipping the same tree: ``tar --zstd`` (zstd level 3) into one object uploaded
with boto3's ``upload_file`` (multipart as boto3 decides). ROUNDS rounds, alternating; each round builds
into a fresh store prefix, then builds the same tree again into that store twice: with this host's index
mirror (nothing new to upload) and with an empty mirror (as another host would). Reports median wall
times, requests by kind, bytes each way, and for the first build packs, chunks and PUTs per pack. Goal:
one PUT per pack object and one per pack index, no more (no multipart uploads, no repeats).

Part 2, dedup. Ten consecutive releases of one PyPI project (sdists from ``pip download``, cached in
/var/cache/dsecfs-test/pypi) are extracted and built as ten layers into one fresh store, once per chunk
size (1 MiB, 64 KiB, 16 KiB). Reports per layer the logical bytes, the new chunk bytes and what the store
grew by, and in all the store's size against the sum of the layers and of the sdists. Goal: dedup saving
(1 - unique chunk bytes / logical bytes, before compression) of at least 60% at the default chunk size.

    .venv/bin/python bench/bench_store.py [--rounds 5] [--tree DIR] [--project pip --versions 23.0,23.0.1,...]
                                          [--chunk-sizes 1048576,65536,16384] [--json]

Requests are counted on the wire, with a botocore event hook on each boto3 client (what S3 bills), and
at the store interface with CountingStore (in the JSON). Builds run in this process; DSECFS_INDEX_DIR
points at a temporary directory, so no index mirror outside it is read or left behind. Needs moto[server]
(a test dependency), ``tar`` with zstd, and network access to PyPI the first time. Exits 1 when a goal
is missed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import boto3
from botocore.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dsec_fs.index_mirror import INDEX_DIR_ENV  # noqa: E402
from dsec_fs.store.s3 import S3Store  # noqa: E402
from dsec_fs.store.wrappers import CountingStore  # noqa: E402
from dsec_fs.store_stats import store_stats  # noqa: E402
from erofs_builder.build import BuildResult, build_layer  # noqa: E402
from tests.s3server import MotoServer  # noqa: E402
from tests.tarextract import extract_tar  # noqa: E402

DEFAULT_TREE = "/var/cache/dsecfs-test/debian-minbase"
PYPI_CACHE = "/var/cache/dsecfs-test/pypi"
DEFAULT_PROJECT = "pip"
# Ten consecutive releases (January to December 2023), each sdist about 2 MB, 7.6 MB and 650 files extracted.
DEFAULT_VERSIONS = "23.0,23.0.1,23.1,23.1.1,23.1.2,23.2,23.2.1,23.3,23.3.1,23.3.2"
DEFAULT_CHUNK_SIZES = "1048576,65536,16384"
BUCKET = "dsecfs-bench"
DEDUP_GOAL = 0.60
MiB = 1 << 20

# S3 operations by the kind of request they are; POST is the start and end of a multipart upload.
KIND_OF = {
    "PutObject": "PUT", "UploadPart": "PUT",
    "CreateMultipartUpload": "POST", "CompleteMultipartUpload": "POST",
    "GetObject": "GET", "HeadObject": "HEAD", "HeadBucket": "HEAD", "ListObjectsV2": "LIST",
    "DeleteObject": "DELETE", "DeleteObjects": "DELETE", "AbortMultipartUpload": "DELETE",
}
KINDS = ("PUT", "POST", "GET", "HEAD", "LIST", "DELETE")
# The top-level store prefixes (dsec_fs/store/keys.py) by which PUTs are told apart.
STORE_AREAS = ("packs", "index", "layers", "refs", "leases")


class RequestCounter:
    """Counts the HTTP requests one boto3 S3 client sends, by kind, and the body bytes each way.

    ``requests[kind]``; ``puts[area]`` (the store area a PUT writes: packs, index, ...; "other" outside
    them); ``sent`` (request bodies); ``received`` (response bodies, HEAD excepted: its Content-Length is
    the object's). botocore calls the hooks on whatever thread sends the request (upload threads, boto3's
    transfer threads); the lock guards every counter.
    """

    def __init__(self, client) -> None:
        self._lock = threading.Lock()
        self.reset()
        client.meta.events.register("before-send.s3", self._on_send)
        client.meta.events.register("after-call.s3", self._on_answer)

    def reset(self) -> None:
        with self._lock:
            self.requests: Counter[str] = Counter()
            self.puts: Counter[str] = Counter()
            self.sent = 0
            self.received = 0

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": dict(self.requests), "puts": dict(self.puts), "sent": self.sent,
                    "received": self.received}

    def _on_send(self, request, event_name: str, **_kwargs) -> None:
        # Returning anything but None would stand in for the response: this hook only looks.
        kind = KIND_OF.get(event_name.rsplit(".", 1)[-1], "OTHER")
        area = next((a for a in request.url.split("?")[0].split("/") if a in STORE_AREAS), "other")
        with self._lock:
            self.requests[kind] += 1
            self.sent += int(request.headers.get("Content-Length") or 0)
            if kind == "PUT":
                self.puts[area] += 1

    def _on_answer(self, http_response, model, **_kwargs) -> None:
        if model.http.get("method") == "HEAD":
            return
        with self._lock:
            self.received += int(http_response.headers.get("content-length") or 0)


@dataclass
class Run:
    """One measured operation: wall seconds and what crossed the wire."""

    seconds: float
    wire: dict
    store_calls: dict = field(default_factory=dict)  # CountingStore's view, for dsecfs builds


def measured_build(store: S3Store, counter: RequestCounter, source: str, **options) -> tuple[Run, BuildResult]:
    """build_layer(source, store, **options), timed; ``counter`` listens on ``store``'s client."""
    counting = CountingStore(store)
    counter.reset()
    start = time.perf_counter()
    result = build_layer(source, counting, **options)
    seconds = time.perf_counter() - start
    return Run(seconds, counter.snapshot(), counting.snapshot()), result


def s3_client(endpoint: str):
    """A plain boto3 client, as a user shipping a tarball would make it (path-style for the local endpoint)."""
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))


def store_usage(admin, prefix: str) -> Counter[str]:
    """Bytes of the objects under store ``prefix`` by area (packs, index, layers, ...), through the
    uncounted admin client."""
    usage: Counter[str] = Counter()
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for obj in page.get("Contents", ()):
            usage[obj["Key"][len(prefix) + 1:].split("/", 1)[0]] += obj["Size"]
    return usage


def delete_prefix(admin, prefix: str) -> None:
    """Delete everything under ``prefix``/, to free moto's memory between rounds."""
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        batch = [{"Key": obj["Key"]} for obj in page.get("Contents", ())]
        if batch:
            admin.delete_objects(Bucket=BUCKET, Delete={"Objects": batch, "Quiet": True})


def fresh_index_dir(work: str) -> None:
    """Point DSECFS_INDEX_DIR at a new empty directory: the next build starts with no index mirror."""
    os.environ[INDEX_DIR_ENV] = tempfile.mkdtemp(prefix="index-", dir=work)


# -- part 1: one large layer against one tarball


def bench_upload(server: MotoServer, admin, tree: str, rounds: int, work: str) -> dict:
    first, rebuild, cold, tar_s, upload = [], [], [], [], []
    baseline_client = s3_client(server.url)
    baseline_counter = RequestCounter(baseline_client)
    tarball = os.path.join(work, "tree.tar.zst")
    for r in range(rounds):
        prefix = f"debian-{r}"
        store = S3Store(BUCKET, prefix, endpoint_url=server.url)
        counter = RequestCounter(store._client)  # S3Store keeps its client private; the bench only listens
        fresh_index_dir(work)
        run, result = measured_build(store, counter, tree, name=f"bench/debian:r{r}")
        first.append(run)
        run, again = measured_build(store, counter, tree, name=f"bench/debian:r{r}")
        rebuild.append(run)
        fresh_index_dir(work)
        run, again_cold = measured_build(store, counter, tree, name=f"bench/debian:r{r}")
        cold.append(run)
        assert again.digest == again_cold.digest == result.digest, "rebuilds of one tree differ"
        store.close()

        start = time.perf_counter()
        subprocess.run(["tar", "--zstd", "-cf", tarball, "-C", tree, "."], check=True)
        tar_s.append(time.perf_counter() - start)
        baseline_counter.reset()
        start = time.perf_counter()
        baseline_client.upload_file(tarball, BUCKET, f"tarball-{r}/tree.tar.zst")
        upload.append(Run(time.perf_counter() - start, baseline_counter.snapshot()))
        tarball_bytes = os.path.getsize(tarball)
        os.unlink(tarball)

        usage = store_usage(admin, prefix)
        delete_prefix(admin, prefix)
        delete_prefix(admin, f"tarball-{r}")
    baseline_client.close()

    stats = result.stats
    packs = len(result.manifest.packs)
    puts = first[-1].wire["puts"]
    return {
        "tree": tree,
        "rounds": rounds,
        "files": stats.files,
        "logical_bytes": stats.bytes,
        "distinct_chunks": stats.distinct_chunks,
        "new_chunks": stats.new_chunks,
        "new_chunk_bytes": stats.new_bytes,
        "compressed_chunk_bytes": stats.stored_bytes,
        "packs": packs,
        "store_bytes": sum(usage.values()),
        "store_bytes_by_area": dict(usage),
        "tarball_bytes": tarball_bytes,
        "pack_puts_per_pack": puts.get("packs", 0) / packs,
        "index_puts_per_pack": puts.get("index", 0) / packs,
        "wire_counts_equal_across_rounds": all(
            runs[0].wire["requests"] == run.wire["requests"] for runs in (first, rebuild, cold) for run in runs
        ),
        "dsecfs_build": summarise(first),
        "dsecfs_rebuild": summarise(rebuild),
        "dsecfs_rebuild_cold_mirror": summarise(cold),
        "tar_zstd_s": statistics.median(tar_s),
        "boto3_upload_file": summarise(upload),
        "tarball_total_s": statistics.median(t + u.seconds for t, u in zip(tar_s, upload)),
    }


def summarise(runs: list[Run]) -> dict:
    """The median wall time over the rounds; the requests and bytes of the last round."""
    return {"seconds": statistics.median(run.seconds for run in runs), "all_seconds": [run.seconds for run in runs],
            **runs[-1].wire, "store_calls": runs[-1].store_calls}


# -- part 2: ten related layers


def sdist(project: str, version: str) -> str:
    """The .tar.gz sdist of ``project`` ``version`` in the cache, downloaded with pip the first time."""
    # Older sdists keep the project's spelling; newer ones normalise it (PEP 625).
    names = {project, project.lower().replace("-", "_").replace(".", "_")}

    def cached() -> list[str]:
        return [path for name in names for path in glob.glob(os.path.join(PYPI_CACHE, f"{name}-{version}.tar.gz"))]

    if not cached():
        os.makedirs(PYPI_CACHE, exist_ok=True)
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "pip"), "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"{project}=={version}", "-d", PYPI_CACHE], check=True)
    found = cached()
    if not found:
        raise SystemExit(f"pip downloaded no {project}-{version}.tar.gz into {PYPI_CACHE}")
    return found[0]


def extract(archive: str, into: str) -> str:
    """Unpack a .tar.gz sdist and return its top directory (name-version/)."""
    extract_tar(archive, into)
    (top,) = os.listdir(into)
    return os.path.join(into, top)


def bench_related(server: MotoServer, admin, project: str, versions: list[str], chunk_sizes: list[int],
                  work: str) -> dict:
    archives = [sdist(project, v) for v in versions]  # downloads first, so that no timing includes them
    trees = [extract(a, os.path.join(work, "src", v)) for a, v in zip(archives, versions)]
    sdist_bytes = sum(os.path.getsize(a) for a in archives)
    by_chunk_size = []
    for chunk_size in chunk_sizes:
        prefix = f"{project}-{chunk_size}"
        store = S3Store(BUCKET, prefix, endpoint_url=server.url)
        counter = RequestCounter(store._client)
        fresh_index_dir(work)
        layers = []
        store_size = 0
        for version, tree in zip(versions, trees):
            run, result = measured_build(store, counter, tree, name=f"bench/{project}:{version}", chunk_size=chunk_size)
            grown_to = sum(store_usage(admin, prefix).values())
            layers.append({
                "version": version,
                "logical_bytes": result.stats.bytes,
                "files": result.stats.files,
                "new_chunks": result.stats.new_chunks,
                "new_chunk_bytes": result.stats.new_bytes,
                "new_compressed_bytes": result.stats.stored_bytes,
                "packs_referenced": len(result.manifest.packs),
                "store_growth_bytes": grown_to - store_size,
                "seconds": run.seconds,
                "requests": run.wire["requests"],
                "puts": run.wire["puts"],
            })
            store_size = grown_to
        totals = store_stats(store)
        store.close()
        delete_prefix(admin, prefix)
        logical = sum(layer["logical_bytes"] for layer in layers)
        by_chunk_size.append({
            "chunk_size": chunk_size,
            "layers": layers,
            "logical_bytes": logical,
            "unique_chunk_bytes": totals["unique_bytes"],
            "pack_bytes": totals["stored_bytes"],
            "store_bytes": store_size,
            "dedup_saving": 1 - totals["unique_bytes"] / logical,
            "store_saving": 1 - store_size / logical,
            "store_vs_sdists": store_size / sdist_bytes,
            "store_stats": totals,
        })
    return {"project": project, "versions": versions, "sdist_bytes": sdist_bytes, "by_chunk_size": by_chunk_size}


# -- output


def kinds_row(wire: dict) -> str:
    return "".join(f"{wire['requests'].get(kind, 0):>7,}" for kind in KINDS)


def print_upload(up: dict) -> None:
    print(f"Part 1: {up['tree']}: {up['files']:,} files, {up['logical_bytes'] / MiB:.1f} MiB; "
          f"median of {up['rounds']} rounds, requests of the last")
    print(f"{'':<34}{'wall s':>8}" + "".join(f"{k:>7}" for k in KINDS) + f"{'sent MiB':>10}{'recv MiB':>10}")
    rows = [("dsecfs build, empty store", up["dsecfs_build"]),
            ("dsecfs rebuild, same host", up["dsecfs_rebuild"]),
            ("dsecfs rebuild, empty mirror", up["dsecfs_rebuild_cold_mirror"]),
            ("tar --zstd + upload_file", {**up["boto3_upload_file"], "seconds": up["tarball_total_s"]})]
    for label, r in rows:
        print(f"{label:<34}{r['seconds']:>8.2f}{kinds_row(r)}{r['sent'] / MiB:>10.2f}{r['received'] / MiB:>10.2f}")
    print(f"  tarball: tar --zstd {up['tar_zstd_s']:.2f} s, upload_file {up['boto3_upload_file']['seconds']:.2f} s, "
          f"{up['tarball_bytes'] / MiB:.1f} MiB")
    puts = up["dsecfs_build"]["puts"]
    areas = ", ".join(f"{area} {n / MiB:.2f}" for area, n in sorted(up["store_bytes_by_area"].items()))
    print(f"  dsecfs: {up['new_chunks']:,} chunks ({up['new_chunk_bytes'] / MiB:.1f} MiB, "
          f"{up['compressed_chunk_bytes'] / MiB:.1f} MiB compressed) in {up['packs']} packs; store "
          f"{up['store_bytes'] / MiB:.2f} MiB ({areas})")
    print(f"  PUTs of the first build by area: {dict(sorted(puts.items()))} -> "
          f"{up['pack_puts_per_pack']:.2f} pack PUT and {up['index_puts_per_pack']:.2f} index PUT per pack")


def print_related(rel: dict) -> None:
    n = len(rel["versions"])
    print(f"\nPart 2: {n} releases of {rel['project']} ({rel['versions'][0]} .. {rel['versions'][-1]}), "
          f"sdists {rel['sdist_bytes'] / MiB:.2f} MiB in all")
    for cs in rel["by_chunk_size"]:
        print(f"chunk size {cs['chunk_size'] // 1024} KiB")
        print(f"  {'version':<10}{'files':>7}{'logical KiB':>13}{'new chunks':>12}{'new KiB':>10}"
              f"{'zstd KiB':>10}{'store +KiB':>12}{'packs':>7}{'requests':>10}{'s':>7}")
        for layer in cs["layers"]:
            print(f"  {layer['version']:<10}{layer['files']:>7,}{layer['logical_bytes'] / 1024:>13,.0f}"
                  f"{layer['new_chunks']:>12,}{layer['new_chunk_bytes'] / 1024:>10,.0f}"
                  f"{layer['new_compressed_bytes'] / 1024:>10,.0f}{layer['store_growth_bytes'] / 1024:>12,.0f}"
                  f"{layer['packs_referenced']:>7}{sum(layer['requests'].values()):>10}{layer['seconds']:>7.2f}")
        print(f"  sum of layers {cs['logical_bytes'] / MiB:.2f} MiB, unique chunks {cs['unique_chunk_bytes'] / MiB:.2f}"
              f" MiB, packs {cs['pack_bytes'] / MiB:.2f} MiB, whole store {cs['store_bytes'] / MiB:.2f} MiB "
              f"({cs['store_vs_sdists']:.2f} x the sdists)")
        print(f"  dedup saving {cs['dedup_saving']:.1%}, with compression and metadata {cs['store_saving']:.1%}")


def check_goals(up: dict, rel: dict) -> dict:
    default = rel["by_chunk_size"][0]
    return {
        "pack_puts_per_pack": {"value": up["pack_puts_per_pack"], "goal": "<= 1", "met": up["pack_puts_per_pack"] <= 1},
        "index_puts_per_pack": {"value": up["index_puts_per_pack"], "goal": "<= 1",
                                "met": up["index_puts_per_pack"] <= 1},
        "no_multipart": {"value": up["dsecfs_build"]["requests"].get("POST", 0), "goal": "== 0",
                         "met": up["dsecfs_build"]["requests"].get("POST", 0) == 0},
        "rebuild_uploads_no_chunks": {"value": up["dsecfs_rebuild"]["puts"].get("packs", 0), "goal": "== 0",
                                      "met": not up["dsecfs_rebuild"]["puts"].get("packs")},
        "dedup_saving": {"value": default["dedup_saving"], "chunk_size": default["chunk_size"],
                         "goal": f">= {DEDUP_GOAL:.0%}", "met": default["dedup_saving"] >= DEDUP_GOAL},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", default=DEFAULT_TREE)
    parser.add_argument("--project", default=DEFAULT_PROJECT)
    parser.add_argument("--versions", default=DEFAULT_VERSIONS, help="comma-separated, oldest first")
    parser.add_argument("--chunk-sizes", default=DEFAULT_CHUNK_SIZES, help="comma-separated; the first is the goal's")
    parser.add_argument("--json", action="store_true", help="print only one JSON object")
    args = parser.parse_args()
    versions = args.versions.split(",")
    chunk_sizes = [int(size) for size in args.chunk_sizes.split(",")]

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dsecfs-bench-store-") as work, MotoServer() as server:
        server.create_bucket(BUCKET)
        os.environ.update(server.env())
        admin = s3_client(server.url)
        upload = bench_upload(server, admin, args.tree, args.rounds, work)
        related = bench_related(server, admin, args.project, versions, chunk_sizes, work)
        admin.close()
    goals = check_goals(upload, related)
    report = {"wall_seconds": time.perf_counter() - start, "upload": upload, "related_layers": related,
              "goals": goals}
    if not args.json:
        print_upload(upload)
        print_related(related)
        print("\ngoals: " + ", ".join(f"{name} {g['value']:.3g} ({g['goal']}) {'met' if g['met'] else 'MISSED'}"
                                      for name, g in goals.items()))
    print(json.dumps(report, indent=None if args.json else 2))
    return 0 if all(g["met"] for g in goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
