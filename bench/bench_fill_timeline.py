"""Where the seconds of a first-ever sandbox start go, against the pull's (issue 13, first-ever): one start
of each, per workload and store, with time stamps from inside the daemon (timeline_probe.py) and the CPU
of the daemon (its trio thread and its other threads), of the command and of the whole machine sampled
from /proc.

    .venv/bin/python bench/bench_fill_timeline.py --cache DIR [--workloads numpy] [--stores s3,3fs]
                                                  [--bins 0.25] [--daemon-args '--fill layer']
                                                  [--fill-alone] [--json OUT]

For each: the pull's timeline (link bytes per bin, tar's CPU, the command), then the first-ever start's
(mounts, the fill's decision, the command's reads and what the misses waited, store reads by priority,
link bytes per bin, fill bytes landed, CPU per bin). ``--fill-alone``: also a fill with no reader: a
layer mounted with fill ``layer`` and nothing read, for its throughput against the pull's stream on the
same store. DIR as bench_sandbox_coldstart.py's --cache (a private copy: profiles are removed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_sandbox_coldstart as cold  # noqa: E402
import timeline_probe  # noqa: E402
from benchlib import log  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
SAMPLE_SECONDS = 0.05


def _jiffies(path: str) -> int | None:
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime


class CpuSampler:
    """CPU seconds over time of: the daemon's trio thread (its main thread) and its other threads; the
    descendants of ``root`` (the daemon, or this process for the pull) by kind: tar (tar, zstd), runc,
    the command (any other); and the whole machine."""

    def __init__(self, daemon_pid: int | None):
        self.daemon_pid = daemon_pid
        self.root = daemon_pid or os.getpid()
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._kind: dict[int, str | None] = {self.root: None}  # pid -> its kind (None: not ours, or the root)
        self._last: dict[int, int] = {}  # descendant pid -> its jiffies when last seen
        self._done: dict[str, int] = {}  # jiffies of descendants gone, by kind
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _classify(self, pid: int, depth: int = 0) -> str | None:
        if pid in self._kind:
            return self._kind[pid]
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            return None
        comm, ppid = head.split("(", 1)[1], int(tail.split()[1])
        ours = ppid == self.root or (depth < 8 and self._classify(ppid, depth + 1) is not None)
        kind = None
        if ours:
            kind = "tar" if comm in ("tar", "zstd") else "runc" if comm.startswith("runc") else "command"
        if kind is not None or ppid != 0:
            self._kind[pid] = kind
        return kind

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            totals: dict[str, float] = {}
            with open("/proc/stat") as f:
                cpu = [int(v) for v in f.readline().split()[1:]]
            totals["machine"] = (sum(cpu) - cpu[3] - cpu[4]) / CLK_TCK
            if self.daemon_pid:
                main = _jiffies(f"/proc/{self.daemon_pid}/task/{self.daemon_pid}/stat") or 0
                whole = _jiffies(f"/proc/{self.daemon_pid}/stat") or 0
                totals["daemon trio"] = main / CLK_TCK
                totals["daemon workers"] = (whole - main) / CLK_TCK
            alive = set()
            for name in os.listdir("/proc"):
                if name.isdigit() and self._classify(int(name)) is not None:
                    jiffies = _jiffies(f"/proc/{name}/stat")
                    if jiffies is not None:
                        self._last[int(name)] = jiffies
                        alive.add(int(name))
            for pid in [pid for pid in self._last if pid not in alive]:
                kind = self._kind.pop(pid)
                self._done[kind] = self._done.get(kind, 0) + self._last.pop(pid)
            for kind in ("command", "tar", "runc"):
                live = sum(j for pid, j in self._last.items() if self._kind[pid] == kind)
                totals[kind] = (self._done.get(kind, 0) + live) / CLK_TCK
            self.samples.append((now, totals))
            self._stop.wait(SAMPLE_SECONDS)

    def binned(self, start: float, bins: float, count: int) -> dict[str, list[float]]:
        """CPU seconds per bin of ``bins`` seconds from ``start``, by group."""
        out: dict[str, list[float]] = {}
        previous = None
        for now, totals in self.samples:
            if previous is not None:
                index = int((now - start) // bins)
                if 0 <= index < count:
                    for group, value in totals.items():
                        out.setdefault(group, [0.0] * count)[index] += value - previous.get(group, 0.0)
            previous = totals
        return out

    def total(self, start: float, end: float) -> dict[str, float]:
        inside = [totals for now, totals in self.samples if start <= now <= end]
        if len(inside) < 2:
            return {}
        return {group: inside[-1].get(group, 0.0) - inside[0].get(group, 0.0) for group in inside[-1]}


@contextlib.contextmanager
def profiled(pid: int, out: str | None):
    """py-spy (next to this Python) sampling ``pid`` into ``out`` (collapsed stacks) while the block runs."""
    if not out:
        yield
        return
    spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--pid", str(pid),
                            "--rate", "200", "--format", "raw", "--threads", "--nonblocking", "--output", out],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)


def _probed_daemon(path: str, source: str | None) -> tuple[str, ...]:
    """The command of a daemon with timeline_probe installed, of this tree or of ``source``'s."""
    tree = os.path.abspath(source) if source else os.path.dirname(HERE)
    return (sys.executable, "-c", f"import sys; sys.path[:0] = [{tree!r}, {HERE!r}]; import timeline_probe; "
            f"timeline_probe.install({path!r}); from cli.main import main; sys.argv[0] = 'dsecfs'; main()")


def _events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _spread(bins: list[float], start: float, t0: float, t1: float, amount: float, width: float) -> None:
    """Add ``amount`` spread evenly over [t0, t1] into ``bins`` (of ``width`` seconds from ``start``)."""
    if t1 <= t0:
        t1 = t0 + 1e-6
    index = int((t0 - start) // width)
    while index < len(bins) and start + index * width < t1:
        lo, hi = max(t0, start + index * width), min(t1, start + (index + 1) * width)
        if index >= 0 and hi > lo:
            bins[index] += amount * (hi - lo) / (t1 - t0)
        index += 1


def _link_bins(events: list[dict], start: float, width: float, count: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for event in events:
        if event["kind"] == "link" and event["bytes"]:
            _spread(out.setdefault(event["what"], [0.0] * count), start, event["t_rtt"], event["t1"],
                    event["bytes"] / 1e6, width)
    return out


def _print_up_spans(events: list[dict], start: float, first_read: float) -> None:
    """The steps of up and of its mounts (timeline_probe.SPANS) that began before the command's first read,
    in the order they began, with their thread; then the store calls of that time."""
    print(f" up to the command's first read ({first_read - start:.3f} s): steps (start-end s, thread)")
    for event in sorted((e for e in events if e["kind"] == "span" and e["t0"] < first_read), key=lambda e: e["t0"]):
        print(f"  {event['t0'] - start:7.3f}-{event['t1'] - start:7.3f} {(event['t1'] - event['t0']) * 1e3:7.1f} ms"
              f"  {event['what']:<40} {event['thread'][:40]}")
    calls = [e for e in events if e["kind"] == "link" and e["t0"] < first_read]
    for event in sorted(calls, key=lambda e: e["t0"]):
        print(f"  store {event['op']:<4} {event['what']:<8} {event['t0'] - start:7.3f}-{event['t1'] - start:7.3f}"
              f" {event['bytes'] / 1e3:9.1f} kB")


def _row(name: str, values: list[float], fmt: str = "{:5.1f}") -> str:
    return f"  {name:<16}" + " ".join(fmt.format(v) for v in values)


def _print_bins(title: str, start: float, width: float, count: int, series: dict[str, list[float]],
                fmt: str = "{:5.1f}") -> None:
    print(f" {title} (per {width:g} s bin from t=0)")
    print("  " + " " * 16 + " ".join(f"{i * width:5.2f}" for i in range(count)))
    for name, values in series.items():
        print(_row(name, values, fmt))


MISS_STEPS = (
    ("to its store read", "the read's start to its store read's queueing: the FUSE read, the memory and chunk "
                          "caches' misses, the flight and its run planned"),
    ("slot", "queued for a store slot"),
    ("to the thread", "the slot granted to the worker thread's start"),
    ("store", "the store call (the emulated link: round trip and transfer)"),
    ("decode", "the worker thread after the store call: decompression and sha256 of the run's chunks"),
    ("back", "the worker thread's return to the flight's task in the trio thread"),
    ("to the reply", "the store read's end to the read's: its flights landed, the reader woken, its bytes cut"),
)


def _miss_steps(events: list[dict], missed: list[dict]) -> tuple[list[list[float]], int]:
    """For each read that waited for the store and queued an on-demand store read of its own (the first it
    queued), the seconds of each of MISS_STEPS; and how many waited for a store read they did not queue
    (one in the air already: a prefetch, a readahead window's)."""
    reads_for: dict[int, list[dict]] = {}  # a ticket's id may be another's after it is gone: matched by time too
    for event in events:
        if event["kind"] == "read_for":
            reads_for.setdefault(event["ticket"], []).append(event)
    links = sorted((e for e in events if e["kind"] == "link" and "thread" in e), key=lambda e: e["t0"])
    store_reads = sorted((e for e in events if e["kind"] == "store_read" and e["priority"] == 0 and "ticket" in e),
                         key=lambda e: e["t_queued"])
    steps, joined = [], 0
    for read in missed:
        own = next((e for e in store_reads if read["t0"] <= e["t_queued"] <= read["t1"] and e["t_granted"]), None)
        worker = next((e for e in reads_for.get(own["ticket"], ())
                       if own["t_granted"] <= e["t0"] and e["t1"] <= own["t1"]), None) if own else None
        if worker is None:
            joined += 1
            continue
        calls = [e for e in links
                 if e["thread"] == worker["thread"] and worker["t0"] <= e["t0"] and e["t1"] <= worker["t1"]]
        store_end = max((e["t1"] for e in calls), default=worker["t0"])
        steps.append([own["t_queued"] - read["t0"], own["t_granted"] - own["t_queued"], worker["t0"] - own["t_granted"],
                      sum(e["t1"] - e["t0"] for e in calls), worker["t1"] - store_end, own["t1"] - worker["t1"],
                      read["t1"] - own["t1"]])
    return steps, joined


def _print_miss_steps(events: list[dict], missed: list[dict]) -> None:
    steps, joined = _miss_steps(events, missed)
    if not steps:
        return
    print(f"  where a miss's time goes ({len(steps)} misses with a store read of their own, {joined} that joined "
          f"one in the air): median / mean ms")
    for n, (name, what) in enumerate(MISS_STEPS):
        column = [row[n] for row in steps]
        print(f"   {name:<18} {_median(column) * 1e3:6.2f} / {sum(column) / len(column) * 1e3:6.2f}  {what}")
    totals = [sum(row) for row in steps]
    print(f"   {'the whole read':<18} {_median(totals) * 1e3:6.2f} / {sum(totals) / len(totals) * 1e3:6.2f}")


def timeline_pull(info: dict, workload: str, store_name: str, work: str, width: float) -> dict:
    _packages, command = cold.WORKLOADS[workload]
    path = os.path.join(work, "pull.jsonl")
    timeline_probe.install(path, daemon=False)
    marks = {}
    orig_run_command = cold.run_command

    def run_command(rootfs, command_):
        marks.setdefault("command_t0", time.monotonic())
        try:
            return orig_run_command(rootfs, command_)
        finally:
            marks.setdefault("command_t1", time.monotonic())

    cold.run_command = run_command
    orig_drop = cold.drop_page_cache

    def drop():
        orig_drop()
        marks.setdefault("t0", time.monotonic())

    cold.drop_page_cache = drop
    try:
        with CpuSampler(None) as cpu:
            result = cold.pull(info, info[workload]["v1"], command, store_name, os.path.join(work, "pull"))
    finally:
        cold.run_command, cold.drop_page_cache = orig_run_command, orig_drop
        timeline_probe.uninstall()
    events = _events(path)
    start, seconds = marks["t0"], result["seconds"]
    count = int(seconds // width) + 1
    link = _link_bins(events, start, width, count)
    print(f"\n== pull, {workload}, {store_name}: {seconds:.2f} s; download ends at "
          f"{max(e['t1'] for e in events if e['kind'] == 'link') - start:.2f} s, command "
          f"{marks['command_t0'] - start:.2f}-{marks['command_t1'] - start:.2f} s")
    _print_bins("link MB", start, width, count, link)
    cpu_bins = cpu.binned(start, width, count)
    _print_bins("CPU s", start, width, count, {k: v for k, v in cpu_bins.items() if k in ("tar", "command", "machine")},
                "{:5.2f}")
    totals = cpu.total(start, start + seconds)
    print(f" CPU over the pull: " + ", ".join(f"{k} {v:.2f} s" for k, v in totals.items() if k != "runc"))
    return {"seconds": seconds, "marks": {k: v - start for k, v in marks.items()}, "cpu": totals,
            "link_mb": sum(sum(v) for v in link.values())}


def timeline_start(info: dict, workload: str, store_name: str, work: str, width: float,
                   daemon_args: tuple[str, ...], layer_stored: dict[str, int], profile: str | None = None,
                   source: str | None = None) -> dict:
    _packages, command = cold.WORKLOADS[workload]
    path = os.path.join(work, "daemon.jsonl")
    node_ = cold.Node_(os.path.join(work, "node"), info["store"], store_name, daemon_args,
                       _probed_daemon(path, source))
    node_.env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cold._forget_profiles(info)
    v1 = info[workload]["v1"]
    try:
        node = node_.start()
        cold.drop_page_cache()
        with CpuSampler(node_.daemon.process.pid) as cpu, profiled(node_.daemon.process.pid, profile):
            start = time.monotonic()
            with node.sandbox(base=info["base"]["ref"], toolkit=v1["ref"]) as sandbox:
                up = time.monotonic()
                result = sandbox.exec(["python3", "-c", command], env=cold.ENV)
                end = time.monotonic()
                if result.exit_code != 0:
                    raise SystemExit(f"the command failed: {result.stderr.decode(errors='replace')[-2000:]}")
            time.sleep(0.3)
    finally:
        node_.stop()
    events = _events(path)
    seconds = end - start
    count = int(seconds // width) + 1
    print(f"\n== first-ever, {workload}, {store_name}, daemon args {' '.join(daemon_args) or '(none)'}: "
          f"{seconds:.2f} s; up {up - start:.2f} s, command {up - start:.2f}-{seconds:.2f} s")
    for event in events:
        if event["kind"] == "mount":
            print(f"  mount {event['ref']}: {event['t0'] - start:.3f}-{event['t1'] - start:.3f} s")
        elif event["kind"] == "fill":
            rt = event["round_trip"]
            print(f"  fill of {event['layer']}: decided {event['wanted']} at {event['t1'] - start:.3f} s "
                  f"(waited {event['t1'] - event['t0']:.3f} s; round trip {rt * 1e3 if rt else float('nan'):.1f} ms)")
    reads = [e for e in events if e["kind"] == "read" and start <= e["t0"] <= end]
    _print_up_spans(events, start, reads[0]["t0"] if reads else end)
    missed = [e for e in reads if e["missed"]]
    if reads:
        print(f"  reads during the command: {len(reads)}, first at {reads[0]['t0'] - start:.3f} s; waited for the "
              f"store: {len(missed)}, {sum(e['t1'] - e['t0'] for e in missed):.2f} s in all (median "
              f"{_median([e['t1'] - e['t0'] for e in missed]) * 1e3:.1f} ms); all reads "
              f"{sum(e['t1'] - e['t0'] for e in reads):.2f} s")
        _print_miss_steps(events, missed)
    reads_in = {p: [e for e in events if e["kind"] == "store_read" and e["granted_as"] == p and e["t1"] <= end]
                for p in (0, 1, 2)}
    for p, name in ((0, "on-demand"), (1, "prefetch"), (2, "fill")):
        rs = reads_in[p]
        if not rs:
            continue
        queue = [(e["t_granted"] or e["t1"]) - e["t_queued"] for e in rs]
        service = [e["t1"] - (e["t_granted"] or e["t_queued"]) for e in rs]
        promoted = sum(e["priority"] != e["granted_as"] for e in rs)
        print(f"  store reads granted {name} by the command's end: {len(rs)} ({promoted} queued lower), "
              f"{sum(e['bytes'] for e in rs) / 1e6:.1f} MB compressed; queued median {_median(queue) * 1e3:.1f} ms, "
              f"served median {_median(service) * 1e3:.1f} ms")
    stored = sum(layer_stored.values())
    fill_bytes = sum(e["bytes"] for e in reads_in[2]) + sum(e["bytes"] for e in reads_in[1])
    ondemand = sum(e["bytes"] for e in reads_in[0])
    print(f"  by the command's end: {(fill_bytes + ondemand) / 1e6:.1f} MB of the layers' {stored / 1e6:.1f} MB "
          f"stored ({(fill_bytes + ondemand) / stored:.0%}; fill/prefetch {fill_bytes / 1e6:.1f} MB)")
    link = _link_bins(events, start, width, count)
    by_priority = {}
    for p, name in ((0, "on-demand"), (2, "fill")):
        bins = [0.0] * count
        for e in events:
            if e["kind"] == "store_read" and e["granted_as"] == p:
                _spread(bins, start, e["t_granted"] or e["t_queued"], e["t1"], e["bytes"] / 1e6, width)
        by_priority[f"reads {name}"] = bins
    _print_bins("link MB", start, width, count, {**link, **by_priority})
    miss_bins = [0.0] * count
    for e in missed:
        _spread(miss_bins, start, e["t0"], e["t1"], e["t1"] - e["t0"], width)
    _print_bins("read waiting s", start, width, count, {"misses": miss_bins}, "{:5.2f}")
    cpu_bins = cpu.binned(start, width, count)
    _print_bins("CPU s", start, width, count,
                {k: v for k, v in cpu_bins.items() if k in ("daemon trio", "daemon workers", "command", "machine")},
                "{:5.2f}")
    totals = cpu.total(start, end)
    print(" CPU over the start: " + ", ".join(f"{k} {v:.2f} s" for k, v in totals.items() if k not in ("tar",)))
    return {"seconds": seconds, "up": up - start, "reads": len(reads), "missed": len(missed),
            "miss_wait": sum(e["t1"] - e["t0"] for e in missed), "cpu": totals,
            "fetched_mb": (fill_bytes + ondemand) / 1e6, "stored_mb": stored / 1e6}


def fill_alone(info: dict, workload: str, store_name: str, work: str, daemon_args: tuple[str, ...],
               layer_stored: dict[str, int], profile: str | None = None, source: str | None = None) -> dict:
    """A layer mounted with fill ``layer`` and nothing read: how fast the fill brings the whole layer."""
    path = os.path.join(work, "alone.jsonl")
    node_ = cold.Node_(os.path.join(work, "alone"), info["store"], store_name, (*daemon_args, "--fill", "layer"),
                       _probed_daemon(path, source))
    node_.env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cold._forget_profiles(info)
    digests = [info["base"]["digest"], info[workload]["v1"]["digest"]]
    stored = sum(layer_stored[d] for d in digests)
    try:
        node = node_.start()
        cold.drop_page_cache()
        with CpuSampler(node_.daemon.process.pid) as cpu, profiled(node_.daemon.process.pid, profile):
            start = time.monotonic()
            with node.sandbox(base=info["base"]["ref"], toolkit=info[workload]["v1"]["ref"]):
                up = time.monotonic()
                while True:
                    layers = {layer.layer: layer for layer in node.status().layers}
                    jobs = [layer for d, layer in layers.items() if d in digests]
                    done = sum(layer.bytes_fetched for layer in jobs)
                    if done >= sum(layer.data_bytes for layer in jobs) * 0.999 or time.monotonic() - start > 60:
                        break
                    time.sleep(0.25)
                end = time.monotonic()
    finally:
        node_.stop()
    cpu_total = cpu.total(start, end)
    mb = stored / 1e6
    print(f"\n== fill alone, {workload}, {store_name}: {end - start:.2f} s for {mb:.1f} MB stored (up {up - start:.2f} s; "
          f"{mb / (end - up):.1f} MB/s after up); CPU " + ", ".join(f"{k} {v:.2f} s" for k, v in cpu_total.items()))
    return {"seconds": end - start, "up": up - start, "mb": mb, "cpu": cpu_total}


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True)
    parser.add_argument("--workloads", default="numpy")
    parser.add_argument("--stores", default="s3,3fs")
    parser.add_argument("--bins", type=float, default=0.25)
    parser.add_argument("--daemon-args", default="")
    parser.add_argument("--fill-alone", action="store_true")
    parser.add_argument("--no-pull", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", metavar="PREFIX", default=None,
                        help="py-spy the daemon: PREFIX-WORKLOAD-STORE-{start,alone}.txt (collapsed stacks)")
    parser.add_argument("--source", metavar="SRC", default=None,
                        help="run the daemon of this tree of the project (say main's) instead of this one's")
    parser.add_argument("--no-start", action="store_true", help="no first-ever start (with --fill-alone)")
    args = parser.parse_args()
    info = cold.setup(args.cache, args.workloads.split(","))
    layer_stored = {}
    for digest in [info["base"]["digest"], *(info[w]["v1"]["digest"] for w in args.workloads.split(","))]:
        with open(os.path.join(info["store"], "layers", digest, "manifest.json")) as f:
            layer_stored[digest] = int(json.load(f)["stats"]["stored_bytes"])
    daemon_args = tuple(shlex.split(args.daemon_args))
    results = []
    work = tempfile.mkdtemp(prefix="dsecfs-timeline-")
    try:
        for workload in args.workloads.split(","):
            stored = {d: layer_stored[d] for d in (info["base"]["digest"], info[workload]["v1"]["digest"])}
            for store_name in args.stores.split(","):
                here = os.path.join(work, f"{workload}-{store_name}")
                os.makedirs(here)
                row = {"workload": workload, "store": store_name, "load": os.getloadavg()[0]}
                if not args.no_pull:
                    row["pull"] = timeline_pull(info, workload, store_name, here, args.bins)
                prefix = f"{args.profile}-{workload}-{store_name}" if args.profile else None
                if not args.no_start:
                    row["first-ever"] = timeline_start(info, workload, store_name, here, args.bins, daemon_args,
                                                       stored, prefix and f"{prefix}-start.txt", args.source)
                if args.fill_alone:
                    row["fill alone"] = fill_alone(info, workload, store_name, here, daemon_args, stored,
                                                   prefix and f"{prefix}-alone.txt", args.source)
                print(f" load average {os.getloadavg()[0]:.2f}")
                results.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
