"""The access-trace report as one self-contained HTML page (plots embedded as PNG, tables sortable by a few
lines of inline JavaScript, no server, no network) plus report.json beside it.

Input is a report_figures.Report (analysis.analyze makes it); this module only draws and lays out, it
computes no figure of its own. It is the one module that imports matplotlib (Agg backend: no display
needed). To stay readable with hundreds of traces, plots show distributions (box plots, percentile bands,
histograms) rather than a line per trace, long tables scroll inside their box, and the per-trace table is
folded away.

Threads: while render_html draws a page, its figures are kept in a module-level pool and drawn again
(_FigurePool), so call render_html and write_report from one thread at a time. Nothing here uses
pyplot's global state.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import random

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dsec_fs.units import human_size

from .report_figures import PRODUCTION_BAND, LayerReport, Report

ROLE_COLORS = {"base": "#4C72B0", "workspace": "#DD8452", "toolkit": "#55A868", "": "#8172B3"}
PLOT_DPI = 100
LABEL_CHARS = 48  # longer paths are shortened from the left in plot labels
FRACTION_COLUMNS = 4  # panels per row of the layers' read-fraction plot


# ---- formatting --------------------------------------------------------------------------------------


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def _ms(value: float) -> str:
    return f"{value:,.1f} ms"


def _short(path: str, limit: int = LABEL_CHARS) -> str:
    return path if len(path) <= limit else "…" + path[-(limit - 1):]


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


# ---- figures -----------------------------------------------------------------------------------------
# Drawing is most of the report's time, and most of a figure's cost is fixed (axes, ticks, their text), so
# each kind of plot has one figure, drawn again for every layer: its axes are emptied, not made anew. Axes
# sit at fixed margins, in inches, sized for the longest label _short lets through, so no layout engine
# runs (constrained layout cost a second layout pass per figure). Measured in bench/bench_report.py.

Margins = tuple[float, float, float, float]  # an axes' left, bottom, right and top margins, in inches


class _FigurePool:
    def __init__(self):
        self._figures: dict[str, tuple[Figure, list]] = {}

    def clear(self) -> None:
        self._figures.clear()

    def get(self, kind: str, width: float, height: float, boxes: list[Margins], *, twin: int | None = None):
        """The figure of ``kind``, ``width`` x ``height`` inches, and its axes, one per box, emptied; with
        ``twin``, one more axes at the end: a second y axis of axes number ``twin``."""
        if kind not in self._figures:
            fig = Figure(dpi=PLOT_DPI)
            FigureCanvasAgg(fig)
            axes = [fig.add_axes((0, 0, 1, 1)) for _ in boxes]
            if twin is not None:
                axes.append(axes[twin].twinx())
            self._figures[kind] = fig, axes
        fig, axes = self._figures[kind]
        fig.set_size_inches(width, height)
        placed = boxes + ([boxes[twin]] if twin is not None else [])
        for ax, (left, bottom, right, top) in zip(axes, placed):
            ax.set_position((left / width, bottom / height, 1 - (left + right) / width, 1 - (bottom + top) / height))
            _empty(ax)
        return fig, axes


def _empty(ax) -> None:
    """Remove what the last drawing put on ``ax`` and let it scale to the next one's data."""
    for container in list(ax.containers):
        container.remove()
    for artist in [*ax.lines, *ax.collections, *ax.patches, *ax.texts]:
        artist.remove()
    if ax.legend_ is not None:
        ax.legend_.remove()
    ax.relim()
    ax.set_autoscale_on(True)
    ax.set_prop_cycle(None)  # the next lines take the first colours again
    ax.set_visible(True)


_FIGURES = _FigurePool()


def _png(fig) -> str:
    """An <img> holding the figure as a base64 PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=PLOT_DPI)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img class="plot" alt="plot" src="data:image/png;base64,{data}">'


# ---- plots -------------------------------------------------------------------------------------------
# Margins: LABEL_IN fits a y axis of tick numbers and a label, PATHS_IN the 40 characters of a shortened
# path at 8 points (TINY_PATHS_IN: at 7), TITLE_IN a title, TICKS_IN an x axis of tick labels and a label.
LABEL_IN, PATHS_IN, TINY_PATHS_IN, TITLE_IN, TICKS_IN, EDGE_IN = 0.75, 2.6, 2.3, 0.35, 0.6, 0.15


def _title(ax, text: str, fontsize: float) -> None:
    """A title at a fixed height: placed automatically, it measured every tick label of the axes first."""
    ax.set_title(text, fontsize=fontsize, y=1.0)


def _band(ax) -> None:
    low, high = PRODUCTION_BAND
    ax.axhspan(low * 100, high * 100, color="#2ca02c", alpha=0.12, zorder=0,
               label=f"production sandboxes {low * 100:.1f}–{high * 100:.1f}%")


def _fraction_plot(report: Report) -> str:
    return _png(_fraction_figure(report))


def _fraction_figure(report: Report):
    """Share of each layer's bytes and files each trace read: a panel per layer (box plots plus the traces
    as dots), each scaled to its own layer, so that a small layer read in large part does not flatten the
    boxes of the big ones."""
    by_layer = {layer.layer: ([], []) for layer in report.layers}
    for s in report.traces:
        by_layer[s.layer][0].append(s.byte_fraction * 100)
        by_layer[s.layer][1].append(s.file_fraction * 100)
    columns = min(len(report.layers), FRACTION_COLUMNS) or 1
    rows = -(-len(report.layers) // columns) or 1
    width, height = max(6.5, 2.6 * columns), 3.4 * rows
    cell_w, cell_h = width / columns, height / rows
    boxes = [(c * cell_w + 0.6, (rows - 1 - r) * cell_h + 0.35, width - (c + 1) * cell_w + EDGE_IN,
              r * cell_h + TITLE_IN) for r in range(rows) for c in range(columns)]
    fig, axes = _FIGURES.get(f"fractions-{rows}x{columns}", width, height, boxes)
    rng = random.Random(0)  # fixed jitter: the same report draws the same picture
    low, high = PRODUCTION_BAND
    for ax, layer in zip(axes, report.layers):
        values = by_layer[layer.layer]
        ax.boxplot(values, showfliers=False, widths=0.5)
        ax.scatter([i + rng.uniform(-0.18, 0.18) for i, vals in enumerate(values, start=1) for _ in vals],
                   [v for vals in values for v in vals], s=8, alpha=0.35,
                   color=ROLE_COLORS.get(layer.roles[0], "#555"), zorder=3)
        top = max([v for vals in values for v in vals] + [high * 100])
        _band(ax)
        ax.set_ylim(0, top * 1.1)
        ax.set_xticks([1, 2], ["bytes read", "files read"])
        ax.set_ylabel("% of the layer", fontsize=9)
        _title(ax, _short(layer.name, 32), fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[len(report.layers):]:
        ax.set_visible(False)
    axes[0].legend(loc="upper right", fontsize=8)
    return fig


def _combination_plot(report: Report) -> str:
    """Per combination, each role's share of the combined bytes read (the top 40 by traces)."""
    combos = sorted(report.combinations, key=lambda c: -sum(m.traces for m in c.members))[:40]
    height = max(2.2, 0.32 * len(combos) + 1)
    fig, (ax,) = _FIGURES.get("combinations", 13, height, [(3.2, TICKS_IN, EDGE_IN, EDGE_IN)])
    ys, lefts, widths, colors = [], [], [], []
    for y, combo in enumerate(combos):
        total_bytes = sum(m.layer_bytes for m in combo.members) or 1
        left = 0.0
        for m in combo.members:
            width = m.mean_bytes_read / total_bytes * 100
            ys.append(y), lefts.append(left), widths.append(width), colors.append(ROLE_COLORS.get(m.role, "#555"))
            left += width
    ax.barh(ys, widths, left=lefts, color=colors, edgecolor="white")
    low, high = PRODUCTION_BAND
    ax.axvspan(low * 100, high * 100, color="#2ca02c", alpha=0.12, zorder=0)
    ax.set_yticks(range(len(combos)), [_short(c.combination or "(no combination)", 40) for c in combos])
    ax.yaxis.set_inverted(True)
    ax.set_xlabel("bytes read, % of the combination's layers (colour: base / workspace / toolkit)")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def _cold_start_plot(layer: LayerReport) -> str:
    band = layer.cold_start
    def mib(values: list[float]) -> list[float]:
        return [v / (1 << 20) for v in values]

    fig, (ax,) = _FIGURES.get("cold-start", 6.4, 3.6, [(LABEL_IN, TICKS_IN, EDGE_IN, TITLE_IN)])
    ax.fill_between(band.t_ms, mib(band.p10), mib(band.p90), alpha=0.25, label="p10–p90 of traces")
    ax.plot(band.t_ms, mib(band.median), lw=2, label="median")
    ax.set_xlabel("ms after mount")
    ax.set_ylabel("MiB of chunks needed")
    _title(ax, "cold start: chunk bytes needed over time", fontsize=11)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    return _png(fig)


def _timeline_plot(layer: LayerReport) -> str:
    rows = layer.timeline.rows
    fig, (ax,) = _FIGURES.get("timeline", 7.6, max(2.5, 0.17 * len(rows) + 1.1),
                              [(TINY_PATHS_IN, TICKS_IN, EDGE_IN, TITLE_IN)])
    waits = [(y, start, end) for y, row in enumerate(rows) for start, end in row.waits]
    ax.barh([y for y, _s, _e in waits], [max(end - start, 0.05) for _y, start, end in waits],
            left=[start for _y, start, _e in waits], height=0.6, color="#d62728", alpha=0.75)
    ax.scatter([row.first_read_ms for row in rows], range(len(rows)), s=10, color="black", zorder=3,
               label="first byte")
    ax.set_yticks(range(len(rows)), [_short(row.path, 40) for row in rows], fontsize=7)
    ax.yaxis.set_inverted(True)
    ax.set_xlabel("ms after mount")
    more = f" (+{layer.timeline.more_files} more files)" if layer.timeline.more_files else ""
    _title(ax, f"files in first-read order, median trace{more}", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles + [Patch(color="#d62728", alpha=0.75)], labels + ["waiting for a fetch"], fontsize=8,
              loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def _waits_and_sizes_plot(layer: LayerReport) -> str:
    fig, (left, right) = _FIGURES.get("waits-and-sizes", 13, 3.8, [
        (PATHS_IN, TICKS_IN, 6.5 + EDGE_IN, TITLE_IN), (6.5 + LABEL_IN, 1.0, EDGE_IN, TITLE_IN)])
    waited = layer.wait_files[:15]
    left.barh(range(len(waited)), [f.wait_ms for f in waited], color="#d62728")
    left.set_yticks(range(len(waited)), [_short(f.path, 40) for f in waited], fontsize=8)
    left.yaxis.set_inverted(True)
    left.set_xlabel("ms waiting for fetches, all traces")
    _title(left, "what the cold start waits on" if waited else "no read waited for a fetch", fontsize=11)
    sizes = layer.read_sizes
    right.bar(range(len(sizes)), [count for _size, count in sizes], color="#4C72B0")
    right.set_xticks(range(len(sizes)), [human_size(size).replace(".0", "") for size, _count in sizes],
                     rotation=45, fontsize=8)
    right.set_xlabel("read size (at least; under twice)")
    right.set_ylabel("reads")
    _title(right, "read sizes", fontsize=11)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return _png(fig)


def _chunk_plot(layer: LayerReport) -> str:
    fig, (left, right, twin) = _FIGURES.get("chunks", 13, 3.8, [
        (LABEL_IN, TICKS_IN, 6.5 + LABEL_IN, TITLE_IN), (6.5 + LABEL_IN, TICKS_IN, EDGE_IN, TITLE_IN)], twin=0)
    estimates = layer.chunk_sizes
    x = [e.chunk_size for e in estimates]
    left.plot(x, [e.mean_bytes / (1 << 20) for e in estimates], marker="o", label="MiB fetched per trace")
    left.plot(x, [e.union_bytes / (1 << 20) for e in estimates], marker="s", ls="--", label="MiB for all traces")
    current = [e for e in estimates if e.current]
    if current:
        left.axvline(current[0].chunk_size, color="grey", ls=":", label="this layer's chunk size")
    left.set_xscale("log", base=2)
    left.set_xticks(x, [human_size(c).replace(".0", "") for c in x])
    left.minorticks_off()
    left.set_ylabel("MiB")
    twin.plot(x, [e.mean_chunks for e in estimates], color="#DD8452", marker="^", label="fetches per trace")
    twin.set_ylabel("fetches per trace")
    handles = left.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    left.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=8, loc="upper left")
    _title(left, "bytes a cold node fetches, by chunk size", fontsize=11)
    left.grid(alpha=0.3)
    # Chunk bytes by the share of traces that read them, in ten bins: the same picture for 5 or 500 traces.
    bins = [0.0] * 10
    for row in layer.chunk_readers:
        bins[min(9, int(row.traces / layer.traces * 10 - 1e-9))] += row.bytes / (1 << 20)
    right.bar([10 * i + 5 for i in range(10)], bins, width=9, color="#55A868")
    right.set_xlabel("% of traces that read the chunk")
    right.set_ylabel("MiB of chunks")
    _title(right, "chunks shared across sandboxes", fontsize=11)
    right.grid(alpha=0.3)
    return _png(fig)


def _prefetch_plot(layer: LayerReport) -> str:
    rows = [p for p in layer.prefetch if p.scope == "all"]
    fig, (ax,) = _FIGURES.get("prefetch", 6.4, 3.6, [(LABEL_IN, TICKS_IN, EDGE_IN, TITLE_IN)])
    x = [p.min_fraction * 100 for p in rows]
    ax.plot(x, [p.coverage * 100 for p in rows], marker="o", label="coverage: needed bytes prefetched")
    ax.plot(x, [p.precision * 100 for p in rows], marker="s", label="precision: prefetched bytes read")
    ax.plot(x, [p.saved_wait_fraction * 100 for p in rows], marker="^", label="fetch wait saved (upper bound)")
    ax.set_xlabel("learned list: chunks read by at least this % of training traces")
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    _title(ax, f"prefetch list quality on held-out traces ({rows[0].test_traces} of "
                 f"{rows[0].test_traces + rows[0].train_traces})", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    return _png(fig)

# ---- tables ------------------------------------------------------------------------------------------


def _table(columns: list[str], rows: list[list]) -> str:
    """A sortable table. A cell is text, a number, or (shown text, sort value) for a number shown formatted."""
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for cell in row:
            if isinstance(cell, tuple):
                shown, value = cell
                cells.append(f'<td class="n" data-v="{value}">{_esc(shown)}</td>')
            elif isinstance(cell, (int, float)):
                cells.append(f'<td class="n">{cell}</td>')
            else:
                cells.append(f"<td>{_esc(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="scroll"><table class="sortable"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def _b(n: float) -> tuple[str, float]:
    return human_size(n), n


def _p(fraction: float) -> tuple[str, float]:
    return _pct(fraction), fraction


def _t(ms: float) -> tuple[str, float]:
    return _ms(ms), ms


def _layers_table(report: Report) -> str:
    rows = [[layer.name, ", ".join(r or "(bare)" for r in layer.roles), layer.traces, _b(layer.layer_bytes),
             layer.layer_files, _b(layer.chunk_size), _p(layer.byte_fraction.median),
             (f"{_pct(layer.byte_fraction.p10)} – {_pct(layer.byte_fraction.p90)}", layer.byte_fraction.p90),
             _p(layer.file_fraction.median), _p(layer.union_byte_fraction), _b(layer.mean_chunk_bytes),
             _t(layer.stalled_ms.median), _t(layer.last_wait_ms.median)] for layer in report.layers]
    return _table(["layer", "roles", "traces", "file bytes", "files", "chunk size", "bytes read (median)",
                   "p10 – p90", "files read (median)", "read by any trace", "chunk bytes / trace",
                   "stalled (median)", "last wait (median)"], rows)


def _combinations_table(report: Report) -> str:
    rows = []
    for combo in report.combinations:
        members = "; ".join(f"{m.role or 'bare'}: {m.name} ({m.traces})" for m in combo.members)
        rows.append([combo.combination or "(no combination)", members, _p(combo.byte_fraction),
                     _p(combo.file_fraction), _t(combo.mean_stalled_ms), "yes" if combo.in_band else "no"])
    low, high = PRODUCTION_BAND
    return _table(["combination", "layers (traces)", "bytes read", "files read", "stalled (sum of means)",
                   f"within {low * 100:.1f}–{high * 100:.1f}%"], rows) + _combination_profiles_table(report)


def _combination_profiles_table(report: Report) -> str:
    """Per combination and layer: the profile its mounts prefetched by, and how well it predicted."""
    rows = [[combo.combination or "(no combination)", f"{m.role or 'bare'}: {m.name}", "; ".join(m.profiles) or "-",
             _b(m.prefetched_bytes), _b(m.prefetched_read_bytes), _b(m.prefetched_unread_bytes),
             _b(m.read_not_prefetched_bytes)]
            for combo in report.combinations for m in combo.members]
    return "<h3>Profiles used, per combination</h3>" + _table(
        ["combination", "layer", "prefetched by", "prefetched", "prefetched, read", "prefetched, never read",
         "read, not prefetched"], rows)


def _layer_section(layer: LayerReport) -> str:
    facts = [
        ("digest", layer.layer), ("traces", f"{layer.traces:,}"),
        ("file bytes / files", f"{human_size(layer.layer_bytes)} / {layer.layer_files:,}"),
        ("blob", f"{human_size(layer.blob_bytes)}, chunk size {human_size(layer.chunk_size)}"),
        ("bytes read per trace", f"median {_pct(layer.byte_fraction.median)} (p10 {_pct(layer.byte_fraction.p10)}, "
                                 f"p90 {_pct(layer.byte_fraction.p90)}, max {_pct(layer.byte_fraction.max)})"),
        ("files read per trace", f"median {_pct(layer.file_fraction.median)}"),
        ("read by any trace", f"{human_size(layer.union_bytes_read)} ({_pct(layer.union_byte_fraction)}) in "
                              f"{layer.union_files_read:,} files"),
        ("chunk bytes fetched", f"{human_size(layer.mean_chunk_bytes)} per trace; {human_size(layer.union_chunk_bytes)} for "
                                f"all; {human_size(layer.core_chunk_bytes)} read by every trace"),
        ("stalled on fetches", f"median {_ms(layer.stalled_ms.median)}, p90 {_ms(layer.stalled_ms.p90)}; last wait "
                               f"median {_ms(layer.last_wait_ms.median)}"),
    ]
    if layer.ambiguous_bytes:
        facts.append(("attributed by first holder", human_size(layer.ambiguous_bytes)))
    parts = ['<dl class="facts">' + "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in facts) + "</dl>"]
    parts.append('<div class="row">' + _cold_start_plot(layer) + _timeline_plot(layer) + "</div>")
    parts.append(_waits_and_sizes_plot(layer))
    parts.append(_chunk_plot(layer))
    parts.append("<h3>Hottest files</h3>" + _table(
        ["path", "size", "traces", "of traces", "mean bytes read", "of the file", "first byte (median)", "waits",
         "wait (all traces)"],
        [[f.path, _b(f.size), f.traces, _p(f.trace_fraction), _b(f.mean_bytes_read), _p(f.read_fraction),
          _t(f.first_read_ms), f.waits, _t(f.wait_ms)] for f in layer.hot_files]))
    parts.append("<h3>Hottest directories</h3>" + _table(
        ["directory", "files below", "bytes below", "traces", "mean bytes read", "of the bytes below"],
        [[d.path, d.files, _b(d.bytes), d.traces, _b(d.mean_bytes_read), _p(d.read_fraction)]
         for d in layer.hot_dirs]))
    parts.append("<h3>Other chunk sizes</h3><p>What a cold node would fetch from the same reads; content "
                 "deduplication at other sizes is unknown and not counted.</p>" + _table(
        ["chunk size", "this layer's", "bytes per trace", "fetches per trace", "bytes for all traces",
         "fetches for all traces", "fetched / read"],
        [[_b(e.chunk_size), "yes" if e.current else "", _b(e.mean_bytes), (f"{e.mean_chunks:,.1f}", e.mean_chunks),
          _b(e.union_bytes), e.union_chunks, (f"{e.amplification:.2f}×", e.amplification)]
         for e in layer.chunk_sizes]))
    if layer.prefetch:
        parts.append("<h3>Prefetch lists</h3><p>Learned from the earlier traces, scored on the later ones, each "
                     "scored trace starting cold. Saved waits assume the prefetch finished before the read.</p>")
        parts.append('<div class="row">' + _prefetch_plot(layer) + "</div>")
        parts.append(_table(
            ["scope", "min share of traces", "learned from", "scored on", "chunks", "list bytes", "coverage",
             "precision", "wasted", "waits saved", "wait saved"],
            [[p.scope, _p(p.min_fraction), p.train_traces, p.test_traces, p.list_chunks, _b(p.list_bytes),
              _p(p.coverage), _p(p.precision), _b(p.wasted_bytes), f"{p.saved_waits} of {p.waits}",
              _t(p.saved_wait_ms)] for p in layer.prefetch]))
    else:
        parts.append("<p>Prefetch lists need at least two traces of the layer (one to learn, one to score).</p>")
    roles = ", ".join(r or "bare" for r in layer.roles)
    return (f'<details class="layer" open><summary><h2>{_esc(layer.name)} '
            f'<small>({_esc(roles)}, {layer.traces} traces)</small></h2></summary>{"".join(parts)}</details>')


def _cross_layer_section(report: Report) -> str:
    x = report.cross_layer
    if x.layers < 2:
        return "<p>The traces are of one layer: nothing is shared across layers.</p>"
    saved = x.read_bytes_per_layer - x.read_bytes_distinct
    text = (f"<p>Chunk bytes read, counted per layer: {human_size(x.read_bytes_per_layer)}; counted once per chunk (one "
            f"node's cache): {human_size(x.read_bytes_distinct)}, {human_size(saved)} less. {x.shared_chunks:,} read chunks "
            f"({human_size(x.shared_bytes)}) are held by more than one of these {x.layers} layers.</p>")
    if not x.top:
        return text
    return text + _table(["chunk", "bytes", "held by", "read in", "traces"],
                         [[s.digest[:16], _b(s.length), ", ".join(s.held_by), ", ".join(s.read_in), s.traces]
                          for s in x.top])


def _traces_table(report: Report) -> str:
    names = {layer.layer: layer.name for layer in report.layers}
    rows = [[s.path, names[s.layer], s.role, s.combination, s.mode, s.started, s.reads, _b(s.bytes_read),
             _p(s.byte_fraction), s.files_read, _b(s.chunk_bytes), s.misses, _t(s.stalled_ms), _t(s.last_wait_ms),
             _t(s.duration_ms), "yes" if s.truncated else ""] for s in report.traces]
    return _table(["trace", "layer", "role", "combination", "mode", "started", "reads", "bytes read", "of layer",
                   "files", "chunk bytes", "waits", "stalled", "last wait", "duration", "truncated"], rows)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1400px;padding:16px 24px;
color:#222}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;display:inline;margin:0}h3{font-size:15px;margin:18px 0 6px}
small{color:#666;font-weight:normal}.meta{color:#555}.note{background:#fff7e0;border-left:4px solid #e0a800;
padding:6px 10px;margin:6px 0}
details.layer{border:1px solid #ddd;border-radius:6px;padding:8px 14px;margin:16px 0}
summary{cursor:pointer}img.plot{max-width:100%;display:block;margin:8px 0}.row{display:flex;flex-wrap:wrap;
gap:12px;align-items:flex-start}.row img.plot{max-width:49%}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:10px 0}dt{color:#555}
dd{margin:0;font-variant-numeric:tabular-nums;word-break:break-all}
.scroll{max-height:460px;overflow:auto;border:1px solid #e3e3e3;border-radius:4px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:left;white-space:nowrap}
th{white-space:normal;vertical-align:bottom}
th{position:sticky;top:0;background:#f4f6f8;cursor:pointer;user-select:none}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.n{text-align:right;font-variant-numeric:tabular-nums}tbody tr:nth-child(even){background:#fafafa}
"""

# Click a column header to sort by it; numbers sort by data-v (the raw value), text by locale order.
JS = """
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0], col = th.cellIndex;
    var descending = th.getAttribute("aria-sort") !== "descending";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", descending ? "descending" : "ascending");
    function key(row) {
      var cell = row.cells[col];
      if (cell.dataset.v !== undefined) return parseFloat(cell.dataset.v);
      var text = cell.textContent.trim(), number = Number(text);
      return text !== "" && !isNaN(number) ? number : text;
    }
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a), y = key(b), order;
      if (typeof x === "number" && typeof y === "number") order = x - y;
      else order = String(x).localeCompare(String(y));
      return descending ? -order : order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  });
});
"""


def render_html(report: Report) -> str:
    """The page; the figures drawn for it are let go at the end (a few MiB of pixels each)."""
    try:
        return _page(report)
    finally:
        _FIGURES.clear()


def _page(report: Report) -> str:
    low, high = PRODUCTION_BAND
    n_traces = len(report.traces)
    parts = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>dsecfs access-trace report: {n_traces} traces</title><style>{CSS}</style></head><body>",
        "<h1>dsecfs access-trace report</h1>",
        f'<p class="meta">{n_traces:,} traces of {len(report.layers)} layer(s), generated {_esc(report.generated)}. '
        f"Production sandboxes read {low * 100:.1f}–{high * 100:.1f}% of an image's bytes (green band).</p>",
    ]
    parts += [f'<p class="note">{_esc(note)}</p>' for note in report.notes]
    parts += ["<h2>Layers</h2>", _fraction_plot(report), _layers_table(report)]
    parts += ["<h2>Combinations</h2>", _combination_plot(report), _combinations_table(report)]
    parts += [_layer_section(layer) for layer in report.layers]
    parts += ["<h2>Chunks shared across layers</h2>", _cross_layer_section(report)]
    parts += [f"<details><summary><h2>Traces <small>({n_traces})</small></h2></summary>", _traces_table(report),
              "</details>", f"<script>{JS}</script></body></html>"]
    return "\n".join(parts)


def write_report(report: Report, out_dir: str | os.PathLike) -> tuple[str, str]:
    """Write OUT_DIR/report.html and OUT_DIR/report.json; returns their paths."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    html_path = os.path.join(out_dir, "report.html")
    json_path = os.path.join(out_dir, "report.json")
    with open(json_path, "w") as f:
        json.dump(report.to_dict(), f, indent=1)
        f.write("\n")
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(report))
    return html_path, json_path
