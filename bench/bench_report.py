"""Report benchmark: `dsecfs trace report` over 500 traces of a Debian workload, and a screenshot of it.

1. Build the cached Debian minbase rootfs into a layer (a fresh local store in a temporary directory).
2. Record what real commands read, with strace, in a chroot of the same rootfs: `dpkg -l`,
   `apt-get --version`, and a shell script that reads a few files. Each read(2)/pread64(2) is a byte range
   of a file. Of a file mapped with mmap(2) or executed, strace cannot see which pages are touched: the
   first 128 KiB window of the mapping and a fixed 40% of the others (the same for every run) count as
   read.
3. Synthesise TRACES traces from those recordings, as the node daemon writes them: each sandbox runs one
   to three of the commands in random order plus a few random files of its task; reads go through a page
   cache (a page is read once), are cut into 128 KiB requests, and half the traces are kernel mode (blob
   ranges, one record per chunk) and half fuse mode. 70% of sandboxes start on a cold node (the first read
   of a chunk waits for a fetch: about 7 ms, lognormal), the rest on a warm one. Times follow the strace
   timestamps plus the waits. Twenty task combinations.
4. Time `dsecfs trace report` in its own process (wall and CPU time, peak RSS), three rounds, and take a
   screenshot of the page with headless Chromium into docs/report-screenshot.png. With `--baseline REV`
   the same traces are also reported by the code of git revision REV (unpacked with `git archive` into the
   temporary directory, run with PYTHONPATH there), the two alternating round by round, and the times are
   shown side by side as ratios, with the CPU time of the report's phases (imports, analysis, the HTML
   page and its plots) measured apart in one more process per round.

    .venv/bin/python bench/bench_report.py [--traces 500] [--rounds 3] [--rootfs DIR] [--no-screenshot]
        [--baseline main]

Needs root (chroot), strace and chromium.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from dsec_fs.store import FilesystemStore  # noqa: E402
from erofs_builder.build import build_layer  # noqa: E402
from lazy_fetch.layer_index import LayerIndex  # noqa: E402
from lazy_fetch.trace import FLAG_BLOB, FLAG_MISS, NO_CHUNK, TraceHeader, TraceWriter  # noqa: E402

DEFAULT_ROOTFS = "/var/cache/dsecfs-test/debian-minbase"
SCREENSHOT = os.path.join(ROOT, "docs", "report-screenshot.png")
WORKLOADS = {
    "dpkg -l": ["dpkg", "-l"],
    "apt-get --version": ["apt-get", "--version"],
    "shell script": ["sh", "-c", "cat /etc/os-release /etc/debian_version >/dev/null; "
                                 "head -c 4096 /usr/share/common-licenses/GPL-3 >/dev/null; "
                                 "grep -q root /etc/passwd; ls /usr/bin >/dev/null"],
}
PAGE = 4096
MAX_REQUEST = 128 << 10  # FUSE max_read and the kernel's default readahead window
COLD_SHARE = 0.7
COMBINATIONS = 20

# A traced syscall line of `strace -ttt -T -y`: time, name, arguments, result, duration.
LINE = re.compile(r"^(\d+\.\d+) (\w+)\((.*)\) = (-?\d+|0x[0-9a-f]+)(?:<[^>]*>)? <\d+\.\d+>$")
FD_PATH = re.compile(r"(\d+)<([^>]*)>")


@dataclass
class Access:
    t: float  # seconds after the command started
    path: str  # inside the rootfs, "/"-rooted, symlinks resolved
    offset: int
    length: int
    mapped: bool = False  # mmap(2)ed or executed: only the pages the program touches are read


def touched(path: str, offset: int, length: int) -> list[tuple[int, int]]:
    """The parts of a mapped range that page faults read: the first 128 KiB window, and each other window
    with a 40% chance that is the same for every run of the same program (programs take the same paths)."""
    windows = range(offset // MAX_REQUEST, -(-(offset + length) // MAX_REQUEST))
    return [(max(offset, w * MAX_REQUEST), min(offset + length, (w + 1) * MAX_REQUEST)) for w in windows
            if w == windows[0] or zlib.crc32(f"{path}:{w}".encode()) % 100 < 40]


def resolve_in_root(root: str, path: str) -> str | None:
    """``path`` as seen by a process chrooted to ``root``, symlinks resolved inside ``root``; None if absent."""
    parts, resolved, hops = [p for p in path.split("/") if p], [], 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved[:-1]
            continue
        if part == ".":
            continue
        host = os.path.join(root, *resolved, part)
        if os.path.islink(host):
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(host)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        if not os.path.lexists(host):
            return None
        resolved.append(part)
    return "/" + "/".join(resolved)


def record_workload(rootfs: str, argv: list[str], work: str) -> list[Access]:
    """What ``argv`` read in a chroot of ``rootfs``, from strace (one output file per process)."""
    prefix = os.path.join(work, "strace")
    for old in glob.glob(prefix + ".*"):
        os.unlink(old)
    subprocess.run(["strace", "-ff", "-qq", "-y", "-ttt", "-T", "-o", prefix,
                    "-e", "trace=chroot,execve,openat,read,pread64,lseek,mmap", "chroot", rootfs, *argv],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = rootfs.rstrip("/") + "/"
    accesses: list[Access] = []
    start = None
    outputs = {int(p.rsplit(".", 1)[1]): p for p in glob.glob(prefix + ".*")}  # pid -> strace output
    for pid, output in sorted(outputs.items()):
        chrooted = pid != min(outputs)  # only the first process ran before chroot(2)
        position: dict[int, int] = {}  # fd -> file offset, for read(2)
        for line in open(output, errors="replace"):
            match = LINE.match(line.strip())
            if not match:
                continue
            t, name, args, result = float(match[1]), match[2], match[3], match[4]
            if name == "chroot" and result == "0":
                chrooted = True
                start = start if start is not None else t
                continue
            if not chrooted or result.startswith("-"):
                continue
            if name == "execve":
                path = resolve_in_root(rootfs, args.split('"')[1])
                host = path and os.path.join(rootfs, path.lstrip("/"))
                if host and os.path.isfile(host):
                    accesses.append(Access(t, path, 0, os.path.getsize(host), mapped=True))
                continue
            fd = FD_PATH.search(args)
            if name == "openat":
                opened = FD_PATH.fullmatch(line.strip().split(" = ", 1)[1].split(" <")[0])
                if opened:
                    position[int(opened[1])] = 0
                continue
            if fd is None or not fd[2].startswith(root) or not os.path.isfile(fd[2]):
                continue
            number, path, n = int(fd[1]), "/" + fd[2][len(root):], int(result, 0)
            fields = [f.strip() for f in args.rsplit(",", 5)]  # from the right: a read's buffer may hold commas
            if name == "lseek":
                position[number] = n
            elif name == "mmap":  # mmap(addr, length, prot, flags, fd, offset)
                accesses.append(Access(t, path, int(fields[-1], 0), int(fields[1]), mapped=True))
            elif n > 0:  # read(fd, buf, count) at the file position, or pread64(fd, buf, count, offset)
                offset = position.get(number, 0) if name == "read" else int(fields[-1])
                if name == "read":
                    position[number] = offset + n
                accesses.append(Access(t, path, offset, n))
    accesses.sort(key=lambda a: a.t)
    first = start if start is not None else (accesses[0].t if accesses else 0.0)
    for a in accesses:
        a.t = max(0.0, a.t - first)
    return accesses


class TraceSynthesizer:
    """Writes traces of one layer from file accesses, as the node daemon would record them."""

    def __init__(self, layer: LayerIndex, ref: str):
        self.layer = layer
        self.ref = ref
        self.nids = {f.path: nid for nid, f in layer.files.items()}
        self.entries = layer.blob_map.entries

    def write(self, path: str, accesses: list[Access], *, rng: random.Random, mode: str, cold: bool,
              combination: str, started_ns: int) -> int:
        """Write the trace; returns its number of records."""
        layer = self.layer
        header = TraceHeader(layer=layer.digest, ref=self.ref, role="base", combination=combination, mode=mode,
                             chunk_size=layer.chunk_size, layer_bytes=layer.layer_bytes,
                             layer_files=layer.layer_files, blob_bytes=layer.blob_bytes, started_ns=started_ns)
        writer = TraceWriter(path, header)
        records = 0
        cached_pages: set[tuple[int, int]] = set()
        fetched: set[int] = set()
        delay_ns = 0  # waits so far push every later read back
        for access in accesses:
            nid = self.nids.get(access.path)
            if nid is None:
                continue
            size = layer.files[nid].size
            ranges = (touched(access.path, access.offset, access.length) if access.mapped
                      else [(access.offset, access.offset + access.length)])
            pages = sorted({p for start, end in ranges for p in range(start // PAGE, -(-min(end, size) // PAGE))
                            if (nid, p) not in cached_pages})
            for start, end in _runs(pages):
                cached_pages.update((nid, p) for p in range(start, end))
                for offset in range(start * PAGE, min(end * PAGE, size), MAX_REQUEST):
                    length = min(MAX_REQUEST, end * PAGE - offset)
                    waited_ns, written = self._read(writer, nid, offset, length, access.t, delay_ns, rng=rng,
                                                    mode=mode, cold=cold, fetched=fetched)
                    delay_ns += waited_ns
                    records += written
        writer.close()
        return records

    def _read(self, writer: TraceWriter, nid: int, offset: int, length: int, t: float, delay_ns: int, *,
              rng: random.Random, mode: str, cold: bool, fetched: set[int]) -> tuple[int, int]:
        """Record one read (one record per chunk in kernel mode); returns (ns it waited, records written)."""
        pieces = self.layer.pieces(nid, offset, length, 0)
        entries = [p.entry for p in pieces if p.entry is not None]
        missing = [e for e in entries if cold and e not in fetched]
        fetched.update(entries)
        latency_us = (sum(int(rng.lognormvariate(8.8, 0.4)) for _ in missing)  # about 7 ms per fetch
                      if missing else rng.randint(15, 80))
        answered_ns = int(t * 1e9) + delay_ns + latency_us * 1000
        flags = FLAG_MISS if missing else 0
        waited_ns = latency_us * 1000 if missing else 0
        if mode == "fuse":
            writer.record(nid=nid, offset=offset, length=length, chunk=entries[0] if entries else NO_CHUNK,
                          latency_us=latency_us, flags=flags, time_ns=answered_ns)
            return waited_ns, 1
        blob_pieces = [piece for piece in pieces if piece.entry is not None]  # the kernel reads no blob for a hole
        for piece in blob_pieces:
            blob_offset = self.entries[piece.entry][0] * PAGE + piece.start % self.layer.chunk_size
            writer.record(nid=0, offset=blob_offset, length=piece.end - piece.start, chunk=piece.entry,
                          latency_us=latency_us, flags=flags | FLAG_BLOB, time_ns=answered_ns)
        return waited_ns, len(blob_pieces)


def _runs(pages: list[int]) -> list[tuple[int, int]]:
    """Consecutive page numbers as [start, end) runs."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return [(a, b) for a, b in runs]


def synthesize(directory: str, layer: LayerIndex, recordings: dict[str, list[Access]], count: int) -> int:
    rng = random.Random(7)
    synth = TraceSynthesizer(layer, "base/debian:12")
    pool = sorted(f.path for f in layer.files.values() if f.size and f.path.startswith(("/usr/share", "/usr/lib")))
    records = 0
    for i in range(count):
        names = rng.sample(sorted(recordings), rng.randint(1, 3))
        accesses, offset = [], 0.0
        for name in names:
            accesses += [Access(a.t + offset, a.path, a.offset, a.length, a.mapped) for a in recordings[name]]
            offset = accesses[-1].t + 0.002 if accesses else offset
        task = rng.sample(pool, min(len(pool), rng.randint(0, 10)))  # files only this sandbox's task reads
        accesses += [Access(offset + 0.001 * k, path, 0, 1 << 30) for k, path in enumerate(task)]
        records += synth.write(os.path.join(directory, f"sandbox-{i:04d}.dtr"), accesses, rng=rng,
                               mode="kernel" if i % 2 else "fuse", cold=rng.random() < COLD_SHARE,
                               combination=f"debian-12+task-{i % COMBINATIONS:02d}+agent-1",
                               started_ns=1_700_000_000 * 10**9 + i * 10**9)
    return records


@dataclass
class Run:
    wall: float  # seconds
    cpu: float  # user + system seconds
    rss: int  # peak, bytes


def time_report(traces: str, out: str, store: str, code: str = ROOT) -> Run:
    """`dsecfs trace report` in its own process, on the code of the tree at ``code``."""
    argv = [sys.executable, "-c", "import sys; from cli.main import main; from cli.trace_cmds import trace; "
            "main.add_command(trace); main(sys.argv[1:])", "trace", "report", traces, "-o", out, "--store", store]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=code, env={**os.environ, "PYTHONPATH": code}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, rusage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"trace report ({code}) failed: {err}")
    return Run(wall, rusage.ru_utime + rusage.ru_stime, rusage.ru_maxrss * 1024)


PHASES = """
import glob, json, sys, time
t0 = time.process_time()
from dsec_fs.store import FilesystemStore
from lazy_fetch.analysis import analyze
from lazy_fetch.report_html import render_html
t1 = time.process_time()
report = analyze(sorted(glob.glob(sys.argv[1] + "/*.dtr")), FilesystemStore(sys.argv[2]))
t2 = time.process_time()
render_html(report)
t3 = time.process_time()
print(json.dumps({"import": t1 - t0, "analyze": t2 - t1, "render": t3 - t2}))
"""


def time_phases(traces: str, store: str, code: str = ROOT) -> dict[str, float]:
    """CPU seconds of the report's phases (imports, analysis, HTML and plots), in a process of their own."""
    done = subprocess.run([sys.executable, "-c", PHASES, traces, store], cwd=code, env={**os.environ, "PYTHONPATH": code},
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def checkout(rev: str, work: str) -> str:
    """The tree of git revision ``rev`` of this repository, unpacked below ``work`` (no worktree is made)."""
    target = os.path.join(work, "baseline")
    os.makedirs(target)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)
    return target


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def screenshot(html: str, png: str, work: str) -> None:
    profile = tempfile.mkdtemp(dir=work)
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                    "--hide-scrollbars", f"--screenshot={png}", "--window-size=1400,3000", "file://" + html],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rootfs", default=DEFAULT_ROOTFS)
    parser.add_argument("--no-screenshot", action="store_true")
    parser.add_argument("--keep", metavar="DIR", help="copy the report directory here")
    parser.add_argument("--baseline", metavar="REV", help="also time the report of this git revision's code")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-report-")
    try:
        store_dir = os.path.join(work, "store")
        t = time.perf_counter()
        digest = build_layer(args.rootfs, FilesystemStore(store_dir, fsync=False), name="base/debian:12").digest
        print(f"layer {digest[:12]} built in {time.perf_counter() - t:.1f} s")
        layer = LayerIndex.open(FilesystemStore(store_dir), digest)
        recordings = {name: record_workload(args.rootfs, argv, work) for name, argv in WORKLOADS.items()}
        for name, accesses in recordings.items():
            print(f"  {name:<18} {len(accesses):>4} accesses, {len({a.path for a in accesses}):>3} files")
        traces = os.path.join(work, "traces")
        os.makedirs(traces)
        t = time.perf_counter()
        records = synthesize(traces, layer, recordings, args.traces)
        print(f"{args.traces} traces, {records:,} records, written in {time.perf_counter() - t:.1f} s")
        out = os.path.join(work, "report")
        baseline = checkout(args.baseline, work) if args.baseline else None
        runs, baseline_runs, phases, baseline_phases = [], [], [], []
        for _ in range(args.rounds):  # alternating, so that both see the same machine
            if baseline:
                baseline_runs.append(time_report(traces, os.path.join(work, "baseline-report"), store_dir, baseline))
                baseline_phases.append(time_phases(traces, store_dir, baseline))
            runs.append(time_report(traces, out, store_dir))
            phases.append(time_phases(traces, store_dir))
        walls = sorted(run.wall for run in runs)
        html = os.path.join(out, "report.html")
        print(f"trace report: {median(walls):.2f} s median of {args.rounds} (min {walls[0]:.2f}, "
              f"max {walls[-1]:.2f}), CPU {median([run.cpu for run in runs]):.2f} s, peak RSS "
              f"{max(run.rss for run in runs) / 2**20:.0f} MiB; report.html {os.path.getsize(html) / 2**20:.1f} MiB, "
              f"report.json {os.path.getsize(os.path.join(out, 'report.json')) / 2**20:.1f} MiB")
        if baseline:
            print(f"{'median of ' + str(args.rounds):<16}{args.baseline:>10}{'this tree':>11}{'ratio':>8}")
            rows = [(label, [pick(r) / unit for r in baseline_runs], [pick(r) / unit for r in runs])
                    for label, unit, pick in (("wall s", 1, lambda r: r.wall), ("CPU s", 1, lambda r: r.cpu),
                                              ("peak RSS MiB", 2**20, lambda r: r.rss))]
            rows += [(f"  {phase} CPU s", [p[phase] for p in baseline_phases], [p[phase] for p in phases])
                     for phase in ("import", "analyze", "render")]
            for label, old_values, new_values in rows:
                old, new = median(old_values), median(new_values)
                print(f"{label:<16}{old:>10.2f}{new:>11.2f}{new / old:>7.2f}x")
        if args.keep:
            shutil.copytree(out, args.keep, dirs_exist_ok=True)
        if not args.no_screenshot:
            screenshot(html, SCREENSHOT, work)
            print(f"screenshot: {os.path.relpath(SCREENSHOT, ROOT)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
