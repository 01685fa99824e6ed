"""Streamed exec (issue 16): ``Sandbox.attach`` (output relayed as it is written) against ``Sandbox.exec``
(output in one answer at the end), on one daemon and one sandbox over the Debian base, runc.

    .venv/bin/python bench/bench_exec_stream.py [--rounds 5] [--mib 64] [--work DIR]

The command prints one line, then writes MIB MiB of zeros to stdout (``head -c``) and exits. Each round runs
it once each way, side by side, which goes first alternating. Per run:

- ``first output``: from the call to the first byte of output in the client's hands (exec: its answer);
- ``wall``: from the call to the exit code;
- ``daemon RSS``: the daemon's resident set, sampled every 5 ms during the run, its peak minus its value
  just before the run (what the daemon held for this command's output).

Prints a table of medians, their ratios (attach / exec), then one JSON object. Needs root and runc.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchlib import log  # noqa: E402

from dsec_fs.client import Node  # noqa: E402
from dsec_fs.sandbox_client import Sandbox  # noqa: E402
from dsec_fs.store import FilesystemStore  # noqa: E402
from erofs_builder.build import build_layer  # noqa: E402

ROOTFS = "/var/cache/dsecfs-test/debian-minbase"
BASE = "base/debian:12"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """The peak of a process's RSS, sampled in a thread while the block runs, minus its value at the start."""

    def __init__(self, pid: int):
        self.pid = pid
        self.grown = 0

    def __enter__(self) -> "PeakRss":
        self._start = rss(self.pid)
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, rss(self.pid))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.grown = max(0, self._peak - self._start)


def run_exec(sandbox: Sandbox, argv: list[str], size: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    result = sandbox.exec(argv)
    t = time.perf_counter() - t0
    assert result.exit_code == 0 and len(result.stdout) == size, (result.exit_code, len(result.stdout))
    return t, t


def run_attach(sandbox: Sandbox, argv: list[str], size: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = None
    received = 0
    with sandbox.attach(argv) as command:
        for _stream, data in command.output():
            if first is None:
                first = time.perf_counter() - t0
            received += len(data)
    wall = time.perf_counter() - t0
    assert command.result.exit_code == 0 and received == size, (command.result, received)
    return first, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-exec-stream-", dir=args.work)
    socket_dir = tempfile.mkdtemp(prefix="bes-", dir="/tmp")
    daemon = sandbox = None
    try:
        store = os.path.join(work, "store")
        log("building the Debian base layer")
        build_layer(ROOTFS, FilesystemStore(store, fsync=False), name=BASE)
        daemon = Node.start_daemon(os.path.join(socket_dir, "daemon.sock"), state_dir=os.path.join(work, "state"),
                                   cache_dir=os.path.join(work, "cache"), store=store,
                                   log_file=os.path.join(work, "daemon.log"), extra_args=["--no-profiles"])
        sandbox = Sandbox(daemon.node, daemon.node.sandbox_up(BASE, name="bench").id)
        size = args.mib << 20
        argv = ["/bin/sh", "-c", f"echo start; head -c {size - len('start') - 1} /dev/zero"]
        ways = {"exec": run_exec, "attach": run_attach}
        samples: dict[str, dict[str, list[float]]] = {w: {"first": [], "wall": [], "rss": []} for w in ways}
        for round_ in range(args.rounds):
            order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
            for way in order:
                with PeakRss(daemon.pid) as peak:
                    first, wall = ways[way](sandbox, argv, size)
                samples[way]["first"].append(first)
                samples[way]["wall"].append(wall)
                samples[way]["rss"].append(peak.grown)
                log(f"round {round_ + 1} {way}: first output {first:.3f} s, wall {wall:.3f} s, "
                    f"daemon RSS +{peak.grown / 2**20:.1f} MiB")
        medians = {w: {k: statistics.median(v) for k, v in s.items()} for w, s in samples.items()}
        print(f"{args.mib} MiB of output, {args.rounds} rounds, medians")
        print(f"{'':8} {'first output s':>15} {'wall s':>10} {'daemon RSS MiB':>15}")
        for way, m in medians.items():
            print(f"{way:8} {m['first']:15.3f} {m['wall']:10.3f} {m['rss'] / 2**20:15.1f}")
        ratios = {k: medians["attach"][k] / medians["exec"][k] if medians["exec"][k] else None
                  for k in ("first", "wall", "rss")}
        print("attach / exec: " + ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in ratios.items()))
        print(json.dumps({"mib": args.mib, "rounds": args.rounds, "samples": samples, "medians": medians,
                          "ratios": ratios}))
    finally:
        if sandbox is not None:
            sandbox.down()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
