"""A layer's blob map on the node (blobmap13): what a mount pays to take the map (seconds, memory held and
at peak), and what each read pays to look in it, this tree against a baseline tree, side by side.

    .venv/bin/python bench/bench_blobmap.py --baseline SRC [--entries 10000,1000000,10000000] [--rounds 3]

For each size a map of that many entries (64 KiB chunks, every fourth one short, unique digests) is made
in a fresh Python process per side and round (the side's tree first on the path; the sides' order turns
round by round), and the process measures:

- ``take``: what the daemon's open does with the map's bytes (open_layer_blob): ``BlobMap.decode`` on a
  tree that has it (main's), else ``EncodedBlobMap`` (this one's); seconds, the median of a few for the
  small maps;
- ``held``: the resident memory the taken map adds (RSS after, less RSS before, the encoding already
  made), and ``peak``: the process's peak RSS over that before (ru_maxrss), both against the encoding's
  size; measured by RSS, not tracemalloc, which slows an allocation-heavy decode many times;
- per call (median of 5 passes over 20,000 random places): ``entries_in`` of a 4 KiB range,
  ``LayerBlob.chunks_for_range`` of 4 KiB and of 128 KiB (what a FUSE read does first), and
  ``LayerBlob.following`` with a 1 MiB budget (what a miss names as readahead).

The report is the median of the rounds per side, and this tree's over the baseline's. The machine's load
average is printed first and last: the machine is shared.
"""

from __future__ import annotations

import argparse
import array
import itertools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNK_BITS = 16
PLACES = 20_000


def make_map(count: int) -> bytes:
    """An encoded map of ``count`` entries, made at C speed from the format's own header and layout."""
    from dsec_fs.blobmap import ENTRY, header

    words_per_entry = ENTRY.size // 4
    lengths = array.array("I", (1000 + i % 60000 if i % 4 == 0 else 1 << CHUNK_BITS for i in range(count)))
    blocks = [-(-n // 4096) for n in lengths]
    starts = array.array("I", itertools.accumulate(blocks, initial=0))
    body = bytearray(count * ENTRY.size)
    words = memoryview(body).cast("I")
    words[0::words_per_entry] = memoryview(starts[:count])
    words[1::words_per_entry] = memoryview(lengths)
    for field in range(2, words_per_entry):  # a digest unlike any other: a different word per entry
        words[field::words_per_entry] = memoryview(array.array("I", range(field << 24, (field << 24) + count)))
    return header(CHUNK_BITS, count, starts[count]) + bytes(body)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def per_call(function, places) -> float:
    """Seconds per call of ``function`` over ``places``, the median of 5 passes."""
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        for place in places:
            function(place)
        passes.append((time.perf_counter() - start) / len(places))
    return statistics.median(passes)


def worker(count: int) -> dict:
    import gc

    from dsec_fs import blobmap
    from dsec_fs.chunks import ChunkIndex
    from lazy_fetch.blob_reader import LayerBlob

    take = (lambda data: blobmap.BlobMap.decode(data, source="bench")) if hasattr(blobmap.BlobMap, "decode") \
        else (lambda data: blobmap.EncodedBlobMap(data, source="bench"))
    data = make_map(count)
    gc.collect()
    before, peak_before = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    blob_map = take(data)
    seconds = [time.perf_counter() - start]
    held = rss() - before
    peak = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max(before, peak_before))
    for _ in range(4 if count <= 1_000_000 else 0):
        start = time.perf_counter()
        take(data)
        seconds.append(time.perf_counter() - start)
    blob = LayerBlob(blob_map, ChunkIndex(), None, label="bench")
    rng = random.Random(13)
    offsets = [rng.randrange(blob.size) for _ in range(PLACES)]
    entries = [rng.randrange(count) for _ in range(PLACES)]
    blob.location = lambda entry, digest: None  # following() asks for locations; none are in this bench
    return {
        "take_s": statistics.median(seconds), "held": held, "peak": peak, "encoded": len(data),
        "entries_in_4k_s": per_call(lambda o: blob_map.entries_in(o, o + 4096), offsets),
        "chunks_for_range_4k_s": per_call(lambda o: blob.chunks_for_range(o, 4096), offsets),
        "chunks_for_range_128k_s": per_call(lambda o: blob.chunks_for_range(o, 128 << 10), offsets),
        "following_1m_s": per_call(lambda e: blob.following(e, 1 << 20), entries),
    }


def run_side(tree: str, count: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(count)], env=env, cwd=tree,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="another tree of this project (git archive main | tar -x -C SRC)")
    parser.add_argument("--entries", default="10000,1000000,10000000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    if not args.baseline:
        parser.error("--baseline is needed")
    print(f"load average at start: {os.getloadavg()}", flush=True)
    sides = {"baseline": os.path.abspath(args.baseline), "this": HERE}
    report = {}
    for count in map(int, args.entries.split(",")):
        results: dict[str, list[dict]] = {side: [] for side in sides}
        for round_number in range(args.rounds):
            order = list(sides) if round_number % 2 == 0 else list(reversed(sides))
            for side in order:
                results[side].append(run_side(sides[side], count))
        median = {side: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
                  for side, rows in results.items()}
        report[count] = median
        encoded = median["this"]["encoded"]
        print(f"\n{count:,} entries ({encoded / 2**20:.1f} MiB encoded), {args.rounds} rounds, medians:")
        print(f"{'':24}{'baseline':>14}{'this':>14}{'this/base':>11}")
        for key, unit, scale in [("take_s", "ms", 1e3), ("held", "x enc", 1 / encoded), ("peak", "x enc", 1 / encoded),
                                 ("entries_in_4k_s", "us", 1e6), ("chunks_for_range_4k_s", "us", 1e6),
                                 ("chunks_for_range_128k_s", "us", 1e6), ("following_1m_s", "us", 1e6)]:
            base, this = median["baseline"][key], median["this"][key]
            ratio = f"{this / base:.2f}" if base else "-"
            print(f"{key + ' (' + unit + ')':24}{base * scale:>14.3f}{this * scale:>14.3f}{ratio:>11}", flush=True)
    print(f"\nload average at end: {os.getloadavg()}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
