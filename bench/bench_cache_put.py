"""The chunk cache's put and get throughput in-process (issue 13, first-ever: the cache writer's one thread
bounds a fill), this tree's cache against another tree's (``--baseline DIR``, say a ``git archive`` of
main before segments) in the same run, rounds alternating between the two.

    .venv/bin/python bench/bench_cache_put.py --baseline DIR [--mib 256] [--rounds 3] [--dir PARENT]

Each round and tree: a child process (that tree's code on sys.path) opens an empty cache in a new
directory under PARENT (default /var/tmp: a real disk, not tmpfs), puts MIB of random chunks of 4-64 KiB
in batches of fetcher.WRITE_BATCH_BYTES (as the fetcher's cache writer hands them over), reads them all
back, then puts as much again into a cache bounded at half of it (every put evicts). Reported per tree:
MB/s of the puts (wall) and their CPU seconds, of the gets, and of the evicting puts; the ratios this /
baseline are what to read (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, os, random, sys, time
tree, directory, total, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, tree)
from dsec_fs.digest import sha256
from lazy_fetch.cache import ChunkCache
from lazy_fetch.fetcher import WRITE_BATCH_BYTES

rng = random.Random(seed)
pool = rng.randbytes(1 << 20)

def chunks(count_bytes, salt):
    made, done = [], 0
    while done < count_bytes:
        size = rng.randrange(4096, 65536)
        start = rng.randrange(0, len(pool) - size)
        data = salt.to_bytes(8, "little") + done.to_bytes(8, "little") + pool[start:start + size - 16]
        made.append((sha256(data), data))
        done += size
    return made

def batches(items):
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += len(item[1])
        if size >= WRITE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch

def timed(work):
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu

first = chunks(total, 1)
with ChunkCache(os.path.join(directory, "a"), 4 * total) as cache:
    put = timed(lambda: [cache.put_many(batch) for batch in batches(first)])
    get = timed(lambda: [cache.get(digest) for digest, _data in first])
    assert cache.stats().hits == len(first)
second = chunks(total, 2)
with ChunkCache(os.path.join(directory, "b"), total // 2) as cache:
    evicting = timed(lambda: [cache.put_many(batch) for batch in batches(first + second)])
    evictions = cache.stats().evictions
print(json.dumps({"put": put, "get": get, "evicting_put": evicting, "chunks": len(first), "evictions": evictions}))
"""


def measure(tree: str, parent: str, total: int, seed: int) -> dict:
    directory = tempfile.mkdtemp(prefix="bench-cache-put-", dir=parent)
    try:
        subprocess.run(["sync"], check=True)
        out = subprocess.run([sys.executable, "-c", CHILD, tree, directory, str(total), str(seed)], check=True,
                             capture_output=True, text=True, cwd=tree).stdout
        return json.loads(out.splitlines()[-1])
    finally:
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="DIR", help="another tree of the project")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees = {"this": os.path.dirname(HERE), "baseline": os.path.abspath(args.baseline)}
    total = args.mib << 20
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name in (trees if round_ % 2 == 0 else reversed(list(trees))):
            results[name].append(measure(trees[name], args.dir, total, seed=round_))
            print(f"round {round_ + 1} {name}: {results[name][-1]} load {os.getloadavg()[0]:.2f}", flush=True)
    medians = {name: {key: [statistics.median(r[key][0] for r in runs), statistics.median(r[key][1] for r in runs)]
                      for key in ("put", "get", "evicting_put")} for name, runs in results.items()}
    mb = total / 1e6
    print(f"\n{args.mib} MiB, {results['this'][0]['chunks']} chunks; medians of {args.rounds} rounds")
    print(f"{'':14}{'this MB/s':>10}{'base MB/s':>10}{'this/base':>10}{'CPU this':>10}{'CPU base':>10}{'ratio':>8}")
    for key, volume in (("put", mb), ("get", mb), ("evicting_put", 2 * mb)):
        this, base = medians["this"][key], medians["baseline"][key]
        print(f"{key:14}{volume / this[0]:>10.1f}{volume / base[0]:>10.1f}{base[0] / this[0]:>9.2f}x"
              f"{this[1]:>9.2f}s{base[1]:>9.2f}s{this[1] / base[1]:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "medians": medians}, f, indent=1)


if __name__ == "__main__":
    main()
