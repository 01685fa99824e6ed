"""``dsecfs trace report|ls|show|prune`` and ``dsecfs prefetch build``: access traces from the terminal.

cli/main.py registers the two groups by name (LazyCommands: imported when a command line names one); its group
turns a DsecError into one line and the error class's exit code (a corrupt trace: 3, naming the file
and the record). TRACE arguments are trace files, or directories, which stand for every ``*.dtr`` file
below them.
"""

from __future__ import annotations

import json
import os
import sys

import click

from dsec_fs.errors import DsecError, InputError
from dsec_fs.store import open_store
from dsec_fs.units import human_size, parse_size
from lazy_fetch.trace import TRACE_SUFFIX

from .common import Duration, emit, json_option, quiet, store_option

FLAG_LETTERS = "MBEP"  # miss, blob (kernel mode), error, prefetch: FLAG_* bits 0..3 of a record


def expand_traces(args: tuple[str, ...]) -> list[str]:
    """Files as given; a directory gives every ``*.dtr`` file below it, in sorted order."""
    paths = []
    for arg in args:
        if os.path.isdir(arg):
            found = sorted(os.path.join(root, name) for root, _dirs, names in os.walk(arg)
                           for name in names if name.endswith(TRACE_SUFFIX))
            if not found:
                raise InputError(f"no *{TRACE_SUFFIX} files in the directory", where=arg)
            paths += found
        elif os.path.exists(arg):
            paths.append(arg)
        else:
            raise InputError("no such trace file or directory", where=arg)
    return paths


def _flags(flags: int) -> str:
    return "".join(letter if flags >> bit & 1 else "-" for bit, letter in enumerate(FLAG_LETTERS))


@click.group()
def trace() -> None:
    """Look at access traces, and report on what sandboxes read."""


@trace.command("report")
@click.argument("traces", nargs=-1, required=True)
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=str),
              help="directory for report.html and report.json")
@store_option
@json_option
def report_cmd(traces: tuple[str, ...], out_dir: str, store_url: str | None, as_json: bool) -> None:
    """Write OUT/report.html (plots, sortable tables) and OUT/report.json from TRACE files or directories."""
    from lazy_fetch.analysis import analyze
    from lazy_fetch.report_html import write_report

    with open_store(store_url) as store:
        report = analyze(expand_traces(traces), store)
    html_path, json_path = write_report(report, out_dir)
    layers = [{"layer": r.layer, "name": r.name, "traces": r.traces, "byte_fraction_median": r.byte_fraction.median,
               "file_fraction_median": r.file_fraction.median, "stalled_ms_median": r.stalled_ms.median}
              for r in report.layers]
    def text() -> str:
        lines = [f"{r.name:<32} {r.traces:>5} traces  bytes read {r.byte_fraction.median * 100:5.1f}% "
                 f"(median of {human_size(r.layer_bytes)})  files {r.file_fraction.median * 100:5.1f}%  "
                 f"stalled {r.stalled_ms.median:,.1f} ms" for r in report.layers]
        lines += _combination_lines(report)
        lines += [f"note: {note}" for note in report.notes]
        return "\n".join([*lines, f"wrote {html_path} and {json_path}"])

    emit(as_json, {"html": html_path, "json": json_path, "traces": len(report.traces), "layers": layers,
                   "notes": report.notes}, text, result=html_path)


def _combination_lines(report) -> list[str]:
    """Per combination and layer: what its mounts prefetched by, and how well that predicted."""
    lines = []
    for combo in report.combinations:
        for m in combo.members:
            lines.append(f"{(combo.combination or '(no combination)')[:16]:<16} {m.role or 'bare':<9} {m.name:<24} "
                         f"by {'; '.join(m.profiles) or 'nothing':<24} prefetched {human_size(m.prefetched_bytes)}: "
                         f"read {human_size(m.prefetched_read_bytes)}, never read "
                         f"{human_size(m.prefetched_unread_bytes)}; read, not prefetched "
                         f"{human_size(m.read_not_prefetched_bytes)}")
    return lines


@trace.command("ls")
@click.argument("paths", nargs=-1, required=True)
@json_option
def ls_cmd(paths: tuple[str, ...], as_json: bool) -> None:
    """One line per trace: layer, role, mode, reads, bytes asked for, waits. Corrupt traces are named on
    stderr and make the exit code non-zero; the others are still listed."""
    from lazy_fetch.trace import FLAG_MISS, read_trace

    rows, failures = [], []
    for path in expand_traces(paths):
        try:
            t = read_trace(path)
        except DsecError as exc:
            failures.append(exc)
            click.echo(f"dsecfs: {exc.kind} error: {exc}", err=True)
            continue
        misses = [r for r in t.records if r.flags & FLAG_MISS]
        rows.append({"path": path, "layer": t.header.layer, "ref": t.header.ref, "role": t.header.role,
                     "combination": t.header.combination, "mode": t.header.mode, "records": len(t.records),
                     "bytes_requested": sum(r.length for r in t.records), "misses": len(misses),
                     "wait_ms": sum(r.latency_us for r in misses) / 1000,
                     "duration_ms": (t.records[-1].time_ns / 1e6) if t.records else 0.0, "truncated": t.truncated})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif not quiet():
        click.echo(f"{'TRACE':<40} {'LAYER':<12} {'ROLE':<9} {'MODE':<6} {'READS':>7} {'ASKED':>10} {'WAITS':>6} "
                   f"{'WAIT MS':>9} {'DURATION':>10}")
        for row in rows:
            click.echo(f"{row['path']:<40} {row['layer'][:12]:<12} {row['role'] or '-':<9} {row['mode']:<6} "
                       f"{row['records']:>7,} {human_size(row['bytes_requested']):>10} {row['misses']:>6,} "
                       f"{row['wait_ms']:>9,.1f} {row['duration_ms']:>8,.0f}ms"
                       + ("  truncated" if row["truncated"] else ""))
    if failures:
        sys.exit(max(exc.exit_code for exc in failures))


@trace.command("prune")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--max-size", default=None, metavar="SIZE", help="remove the oldest traces until the rest fit")
@click.option("--max-age", type=Duration(), default=None, metavar="DURATION",
              help="remove traces last written longer ago than this (e.g. 7d)")
@click.option("--dry-run", is_flag=True, help="list what would be removed, remove nothing")
@json_option
def prune_cmd(directory: str, max_size: str | None, max_age: float | None, dry_run: bool, as_json: bool) -> None:
    """Remove old *.dtr traces directly in DIRECTORY, by age and by total size.

    A node daemon prunes its own trace directory (see `dsecfs daemon --trace-keep-size/--trace-keep-age`)
    and keeps the traces it is writing; this command is for directories of collected traces."""
    from lazy_fetch.trace import prune_traces

    if max_size is None and max_age is None:
        raise InputError("say --max-size, --max-age or both", where="trace prune")
    result = prune_traces(directory, max_bytes=None if max_size is None else parse_size(max_size), max_age=max_age,
                          dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    emit(as_json, {"removed": result.removed, "removed_bytes": result.removed_bytes, "kept": result.kept,
                   "kept_bytes": result.kept_bytes, "dry_run": dry_run},
         lambda: "\n".join([*(f"{verb} {path}" for path in result.removed),
                             f"{verb} {len(result.removed)} traces ({human_size(result.removed_bytes)}); "
                             f"{result.kept} kept ({human_size(result.kept_bytes)})"]))


@trace.command("show")
@click.argument("path", type=click.Path(dir_okay=False, path_type=str))
@click.option("--limit", default=50, show_default=True, help="records to print (0: all)")
@click.option("--store", "store_url", default=None, metavar="URL",
              help="name the file each record read, from the layer in this store")
@json_option
def show_cmd(path: str, limit: int, store_url: str | None, as_json: bool) -> None:
    """The header and records of one trace. Flags: M fetched (miss), B blob (kernel mode), E error,
    P prefetch."""
    from dataclasses import asdict

    from lazy_fetch.layer_index import LayerIndex
    from lazy_fetch.trace import NO_CHUNK, read_trace

    t = read_trace(path)
    records = t.records if limit <= 0 else t.records[:limit]
    layer = None
    if store_url is not None:
        with open_store(store_url) as store:
            layer = LayerIndex.open(store, t.header.layer)

    def where(record) -> str:
        if layer is None:
            return ""
        pieces = layer.pieces(record.nid, record.offset, record.length, record.flags)
        if pieces is None:
            return "(not a regular file of the layer)"
        spans: list[list[int]] = []  # [nid, start, end], neighbouring pieces of one file joined
        for p in pieces:
            if spans and spans[-1][0] == p.nid and spans[-1][2] == p.start:
                spans[-1][2] = p.end
            else:
                spans.append([p.nid, p.start, p.end])
        return ", ".join(f"{layer.files[nid].path}@{start}+{end - start}" for nid, start, end in spans[:3]) + \
            (" ..." if len(spans) > 3 else "")

    if as_json:
        click.echo(json.dumps({"path": path, "header": asdict(t.header), "records": len(t.records),
                               "truncated": t.truncated,
                               "shown": [dict(asdict(r), file=where(r)) for r in records]}, indent=2))
        return
    for name, value in sorted(asdict(t.header).items()):
        click.echo(f"{name:<12} {value}")
    click.echo(f"{'records':<12} {len(t.records):,}" + ("  (truncated: the last record was cut short)"
                                                        if t.truncated else ""))
    click.echo(f"\n{'TIME MS':>10} {'FLAGS':<5} {'NID':>8} {'OFFSET':>12} {'LENGTH':>8} {'CHUNK':>7} {'LAT US':>8}"
               + ("  FILE" if layer else ""))
    for r in records:
        chunk = "hole" if r.chunk == NO_CHUNK else str(r.chunk)
        click.echo(f"{r.time_ns / 1e6:>10.3f} {_flags(r.flags):<5} {r.nid:>8} {r.offset:>12} {r.length:>8} "
                   f"{chunk:>7} {r.latency_us:>8}" + (f"  {where(r)}" if layer else ""))
    if len(records) < len(t.records):
        click.echo(f"... {len(t.records) - len(records):,} more (--limit 0 shows all)")


@click.group()
def prefetch() -> None:
    """Prefetch lists: the chunks sandboxes of a layer read first, fetched ahead in the background."""


@prefetch.command("build")
@click.argument("traces", nargs=-1, required=True)
@click.option("-o", "--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="prefetch list file to write (JSON)")
@click.option("--min-fraction", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="list a chunk when at least this share of the traces read it")
@store_option
@json_option
def build_cmd(traces: tuple[str, ...], out_path: str, min_fraction: float, store_url: str | None,
              as_json: bool) -> None:
    """Learn a layer's prefetch list from its TRACE files (all of one layer) and write it to OUT."""
    from lazy_fetch.analysis import learn_prefetch_list
    from lazy_fetch.prefetch_list import save

    with open_store(store_url) as store:
        plist = learn_prefetch_list(expand_traces(traces), store, min_fraction=min_fraction)
    save(plist, out_path)
    data = {"path": out_path, "layer": plist.layer, "traces": plist.traces, "min_fraction": plist.min_fraction,
            "chunks": len(plist.entries), "bytes": plist.bytes}
    emit(as_json, data, lambda: f"{len(plist.entries):,} chunks ({human_size(plist.bytes)}) of layer "
                                f"{plist.layer[:12]}, learned from {plist.traces} traces, written to {out_path}",
         result=out_path)
