"""What a first command's fetched bytes are made of (issue 13, the bytes goal): the chunks it read, and
what the daemon's miss readahead brought that it never read; beside them the bytes the kernel asked for.

    .venv/bin/python bench/bench_fetch_split.py [--workloads numpy,boto3,sympy] [--store 3fs]
        [--variant 'NAME=DAEMON ARGS [chunk=SIZE] [dsecfs=PATH]' ...]

The layers, workloads and emulated stores of bench_sandbox_coldstart.py (``chunk=SIZE``: layers built in
chunks of SIZE, in a store of their own). Each variant: a fresh daemon (``--fill none --no-profiles`` and
the variant's arguments), page cache dropped, ``sandbox up`` of base + toolkit and the first command, as
that bench's ``first-ever, fill none`` series. Then, per layer, from the daemon's trace (kernel mode: the
blob ranges EROFS asked for) and its cache directory (the chunks it holds):

- ``fetched``: the chunk bytes the daemon fetched (status ``bytes_fetched``);
- ``read chunks``: the bytes of the chunks the command's reads touched;
- ``readahead unread``: fetched chunks no read touched: what miss readahead brought for nothing;
- ``kernel asked``: the bytes of the blob the kernel read (the union of the trace's ranges), which with
  ``--read-ahead 4KiB`` is close to the pages the command touched; with more, the kernel's own readahead
  (and read-around of page faults in mapped files) is in it.

It also names the files whose chunks were fetched and never read, biggest first.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench_sandbox_coldstart import ENV, WORKLOADS, Node_, parse_variant, setup  # noqa: E402
from benchlib import drop_caches, log  # noqa: E402
from dsec_fs.store import FilesystemStore  # noqa: E402
from lazy_fetch.cache import read_index  # noqa: E402
from lazy_fetch.layer_index import LayerIndex  # noqa: E402
from lazy_fetch.trace import FLAG_ERROR, FLAG_PREFETCH, read_trace  # noqa: E402

TOP = 5
SEQUENCE_BYTES = 4 << 20  # files at least this big get their reads in order in --dump


def start(info: dict, workload: str, store_name: str, daemon_args: tuple[str, ...], command: tuple[str, ...] | None,
          work: str) -> tuple[int, int, str]:
    """The first command on a fresh daemon; returns its fetched bytes, the layers' bytes and its home."""
    toolkit = info[workload]["v1"]
    node_ = Node_(work, info["store"], store_name, ("--fill", "none", "--no-profiles", *daemon_args), command)
    try:
        node = node_.start()
        drop_caches()
        with node.sandbox(base=info["base"]["ref"], toolkit=toolkit["ref"]) as sandbox:
            result = sandbox.exec(["python3", "-c", WORKLOADS[workload][1]], env=ENV)
            if result.exit_code != 0:
                raise SystemExit(f"the command failed: {result.stderr.decode(errors='replace')[-2000:]}")
            layers = {layer.layer: layer for layer in node.status().layers}
        digests = (info["base"]["digest"], toolkit["digest"])
        return (sum(layers[d].bytes_fetched for d in digests), sum(layers[d].data_bytes for d in digests),
                os.path.join(work, f"cache-{node_.cache}"))
    finally:
        node_.stop()


def split(store_dir: str, work: str, cache_dir: str) -> dict:
    cached = set(read_index(cache_dir))
    totals = {"read_chunks": 0, "unread": 0, "asked": 0, "unread_in_read_files": 0}
    unread_files: dict[str, int] = {}
    per_file: dict[str, dict] = {}  # path -> size, fetched, read chunk bytes, asked bytes, chunk size
    with FilesystemStore(store_dir, create=False) as store:
        for path in glob.glob(os.path.join(work, "state", "traces", "*.dtr")):
            trace = read_trace(path)
            layer = LayerIndex.open(store, trace.header.layer)
            access = layer.access(trace)
            totals["asked"] += access.bytes_read()
            read = {piece.entry for record in trace.records if not record.flags & (FLAG_PREFETCH | FLAG_ERROR)
                    for piece in layer.pieces(record.nid, record.offset, record.length, record.flags) or ()
                    if piece.entry is not None}
            entries = layer.blob_map.entries
            totals["read_chunks"] += sum(entries[entry][2] for entry in read)

            def row(nid: int) -> dict:
                file = layer.files[nid]
                return per_file.setdefault(file.path, {"size": file.size, "fetched": 0, "read_chunks": 0, "asked": 0})

            for nid, spans in access.ranges.items():
                found = row(nid)
                found["asked"] += sum(end - start for start, end in spans)
                found.setdefault("spans", []).extend(spans)
            for record in trace.records:
                for piece in layer.pieces(record.nid, record.offset, record.length, record.flags) or ():
                    if layer.files[piece.nid].size >= SEQUENCE_BYTES:
                        row(piece.nid).setdefault("reads", []).append(
                            (record.time_ns // 1000, piece.start, piece.end - piece.start, record.flags))
            read_files = set()
            for entry in read:
                owner = layer.owner[entry]
                if owner:
                    row(owner[0])["read_chunks"] += entries[entry][2]
                    read_files.add(owner[0])
            for entry, (_blkaddr, digest, length) in enumerate(entries):
                owner = layer.owner[entry]
                if digest in cached and owner:
                    row(owner[0])["fetched"] += length
                if digest in cached and entry not in read:
                    totals["unread"] += length
                    name = layer.files[owner[0]].path if owner else "(no file)"
                    unread_files[name] = unread_files.get(name, 0) + length
                    if owner and owner[0] in read_files:
                        totals["unread_in_read_files"] += length
    totals["top_unread"] = sorted(unread_files.items(), key=lambda item: -item[1])[:TOP]
    totals["files"] = per_file
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--store", default="3fs")
    parser.add_argument("--cache", default="/var/cache/dsecfs-test/sandbox-coldstart")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS")
    parser.add_argument("--dump", metavar="PATH", help="write every start's split, per file, as JSON")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    variants = [parse_variant(text) for text in args.variant] or [parse_variant("default=")]
    infos = {chunk_size: setup(args.cache, workloads, chunk_size) for chunk_size in sorted({v[1] for v in variants})}
    work = tempfile.mkdtemp(prefix="dsecfs-split-")
    dumped = {}
    try:
        for workload in workloads:
            for name, chunk_size, daemon_args, command in variants:
                home = os.path.join(work, f"{workload}-{name}")
                info = infos[chunk_size]
                fetched, total, cache_dir = start(info, workload, args.store, daemon_args, command, home)
                parts = split(info["store"], home, cache_dir)
                print(f"{workload} {name}: fetched {fetched / 1e6:.1f} MB ({fetched / total:.1%} of "
                      f"{total / 1e6:.1f} MB) = read chunks {parts['read_chunks'] / 1e6:.1f}"
                      f" + readahead unread {parts['unread'] / 1e6:.1f}"
                      f" (in files read {parts['unread_in_read_files'] / 1e6:.1f});"
                      f" kernel asked {parts['asked'] / 1e6:.1f} MB ({parts['asked'] / total:.1%})", flush=True)
                for path, length in parts["top_unread"]:
                    log(f"  unread {length / 1e6:.2f} MB of {path}")
                shutil.rmtree(home, ignore_errors=True)
                dumped[f"{workload} {name}"] = {"fetched": fetched, "layers": total, **parts}
                if args.dump:
                    with open(args.dump, "w") as f:
                        json.dump(dumped, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
