"""The CPU of the miss readahead's file map (lazy_fetch/miss_readahead.py ``FileChunks``) for the cold-start
layers (bench_sandbox_coldstart.py's: the Debian + python3 base and each toolkit), against another tree of
the project side by side (issue 13, first-ever: the map is built at a layer's first mount, in a worker
thread, under the GIL with the rest of `up` and the command's first reads).

    .venv/bin/python bench/bench_file_map.py --baseline SRC [--cache DIR] [--rounds 9]

Each round runs one process per tree (their order turning round by round); a process reads each
layer's meta.erofs and blob map from the store (not timed), then makes the map three times and reports
the least CPU time (time.process_time) of the three per layer. A tree with ``FileChunks.of_image``
reads the image's records; an older one walks ``LayerIndex.of_files`` and makes ``FileChunks.of`` of it,
as its daemon did. Printed: per layer, the median over the rounds of each tree and their ratio.

Threads: one (and a subprocess at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CACHE = "/var/cache/dsecfs-test/sandbox-coldstart"

MEASURE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from dsec_fs.blobmap import EncodedBlobMap
from dsec_fs.layer import open_layer
from dsec_fs.store import open_store
from lazy_fetch.miss_readahead import FileChunks
store = open_store(sys.argv[2])
out = {}
for name, digest in json.loads(sys.argv[3]).items():
    layer = open_layer(store, digest)
    blob_map = EncodedBlobMap(layer.blobmap, source="blobmap")
    if hasattr(FileChunks, "of_image"):
        make = lambda: FileChunks.of_image(layer.meta, blob_map, source="meta.erofs")
    else:
        from lazy_fetch.layer_index import LayerIndex
        make = lambda: FileChunks.of(LayerIndex.of_files(layer, blob_map))
    times = []
    for _ in range(3):
        started = time.process_time()
        files = make()
        times.append(time.process_time() - started)
    out[name] = {"seconds": min(times), "files": len(files.files)}
print(json.dumps(out))
"""


def layers_of(cache: str) -> dict[str, str]:
    with open(os.path.join(cache, "layers.json")) as f:
        info = json.load(f)
    found = {"base": info["base"]["digest"]}
    for workload, versions in info.items():
        if workload != "base":
            found[workload] = versions["v1"]["digest"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="SRC", help="another tree of the project")
    parser.add_argument("--cache", default=DEFAULT_CACHE)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    trees = {"this": HERE, "baseline": os.path.abspath(args.baseline)}
    layers = layers_of(args.cache)
    store = "file://" + os.path.join(os.path.abspath(args.cache), "store")
    seconds: dict[str, dict[str, list[float]]] = {tree: {name: [] for name in layers} for tree in trees}
    files: dict[str, dict[str, int]] = {}
    for round_number in range(args.rounds):
        order = list(trees) if round_number % 2 == 0 else list(reversed(trees))
        for tree in order:
            done = subprocess.run([sys.executable, "-c", MEASURE, trees[tree], store, json.dumps(layers)],
                                  check=True, capture_output=True, text=True, cwd="/")
            for name, result in json.loads(done.stdout).items():
                seconds[tree][name].append(result["seconds"])
                files.setdefault(tree, {})[name] = result["files"]
    print(f"load average {os.getloadavg()[0]:.2f}; medians of {args.rounds} rounds, CPU ms")
    for name in layers:
        this, base = (statistics.median(seconds[tree][name]) for tree in ("this", "baseline"))
        same = "" if files["this"][name] == files["baseline"][name] else " (file counts differ!)"
        print(f"  {name:<8} {files['this'][name]:>6} files: this {this * 1e3:6.1f}  baseline {base * 1e3:6.1f}"
              f"  ratio {this / base:.2f}{same}")


if __name__ == "__main__":
    main()
