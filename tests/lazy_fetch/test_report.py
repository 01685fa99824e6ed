"""The report end to end through the CLI (``dsecfs trace report|ls|show``, ``dsecfs prefetch build``) on
traces of real layers, and the HTML page opened in headless Chromium (Debian's ``chromium``) over the
DevTools protocol: no console errors, every plot decoded, tables sort on click, a screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import select
import shutil
import struct
import subprocess
import tempfile
import time

import pytest
from click.testing import CliRunner

from cli.main import main as dsecfs
from lazy_fetch.prefetch_list import load
from lazy_fetch.trace import RECORD
from tests.lazy_fetch.analysis_support import BASE_FILES, FUSE_BYTES, KERNEL_BYTES, WORKLOAD, Read, write_trace

PLOTS_PER_LAYER = 5  # cold start, timeline, waits + read sizes, chunk sizes + sharing, prefetch
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*args: str):
    return CliRunner().invoke(dsecfs, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def traces(layers, tmp_path_factory) -> str:
    """Eight sandboxes of two combinations, in both modes: a base and a workspace trace each."""
    directory = tmp_path_factory.mktemp("traces")
    for i in range(8):
        extra = [Read("usr/share/doc/unread", 0, 8192, 8000, latency_us=1000, miss=True)] if i % 4 == 3 else []
        write_trace(directory / f"base-{i}.dtr", layers.base, WORKLOAD + extra, mode="kernel" if i % 2 else "fuse",
                    combination=f"combo-{i % 2}", ref="base/test:1", started_ns=i)
        write_trace(directory / f"ws-{i}.dtr", layers.workspace, [
            Read("work/main.py", 0, 4096, 500, latency_us=250, miss=True),
            Read("work/data.bin", 65536 * (i % 3), 65536, 700, latency_us=300, miss=True),
        ], role="workspace", combination=f"combo-{i % 2}", ref="ws/repo:1", started_ns=i)
    return str(directory)


@pytest.fixture(scope="module")
def report_dir(layers, traces, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("report"))
    result = run("trace", "report", traces, "-o", out, "--store", layers.store.url, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["traces"] == 16 and summary["html"] == os.path.join(out, "report.html")
    assert [layer["name"] for layer in summary["layers"]] == ["base/test:1", "ws/repo:1"]
    return out


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_report_json_and_html(report_dir):
    with open(os.path.join(report_dir, "report.json")) as f:
        data = json.load(f)
    assert len(data["traces"]) == 16 and [layer["name"] for layer in data["layers"]] == ["base/test:1", "ws/repo:1"]
    by_path = {os.path.basename(t["path"]): t for t in data["traces"]}
    assert by_path["base-0.dtr"]["bytes_read"] == FUSE_BYTES and by_path["base-1.dtr"]["bytes_read"] == KERNEL_BYTES
    assert by_path["base-3.dtr"]["files_read"] == 6 and by_path["base-0.dtr"]["files_read"] == 5
    assert by_path["ws-1.dtr"]["bytes_read"] == 3000 + 65536
    assert [c["combination"] for c in data["combinations"]] == ["combo-0", "combo-1"]
    base = data["layers"][0]
    assert base["layer_files"] == len(BASE_FILES) and len(base["prefetch"]) == 5 + 2  # thresholds + combinations

    with open(os.path.join(report_dir, "report.html"), encoding="utf-8") as f:
        page = f.read()
    images = _images(page)
    assert len(images) == 2 + 2 * PLOTS_PER_LAYER
    for png in images:
        assert png.startswith(PNG_SIGNATURE)
        width, height = struct.unpack(">II", png[16:24])
        assert width >= 400 and height >= 200
    # Self-contained: nothing is fetched from anywhere.
    assert not re.search(r'(src|href)="(https?:|//|file:)', page) and "<script src" not in page
    assert "/usr/share/doc/unread" in page and page.count('<table class="sortable">') >= 10
    for section in ("<h2>Layers</h2>", "<h2>Combinations</h2>", "<h2>Chunks shared across layers</h2>",
                    "<h2>Traces <small>(16)</small></h2>"):
        assert page.count(section) == 1, section
    for layer in ("base/test:1", "ws/repo:1"):  # each layer's section, open, with its plots and tables
        section = page.split(f'<details class="layer" open><summary><h2>{layer} ')[1].split("</details>")[0]
        assert len(_images(section)) == PLOTS_PER_LAYER
        for heading in ("Hottest files", "Hottest directories", "Other chunk sizes", "Prefetch lists"):
            assert f"<h3>{heading}</h3>" in section, (layer, heading)


class DevTools:
    """Chromium driven over --remote-debugging-pipe: JSON messages ending in NUL, on the child's fds 3 (in)
    and 4 (out)."""

    def __init__(self, argv: list[str]):
        to_child, self._to_child = os.pipe()
        self._from_child, from_child = os.pipe()

        def wire_pipes() -> None:  # in the child, before exec: move the pipe ends onto fds 3 and 4
            high_in = fcntl.fcntl(to_child, fcntl.F_DUPFD, 100)
            high_out = fcntl.fcntl(from_child, fcntl.F_DUPFD, 100)
            os.dup2(high_in, 3)
            os.dup2(high_out, 4)

        self.proc = subprocess.Popen(argv + ["--remote-debugging-pipe"], pass_fds=(3, 4), preexec_fn=wire_pipes,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self.events: list[dict] = []
        self._buffer = b""
        self._id = 0

    def call(self, method: str, params: dict | None = None, *, session: str | None = None, timeout: float = 30):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self.receive(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, event: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == event for e in self.events):
            self.events.append(self.receive(deadline))

    def receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_child], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("chromium did not answer")
            data = os.read(self._from_child, 1 << 16)
            if not data:
                raise EOFError("chromium closed the pipe")
            self._buffer += data
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
            self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            os.close(self._to_child)
            os.close(self._from_child)

    def console_errors(self) -> list[str]:
        errors = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                errors.append(f"{details.get('text')} {details.get('exception', {}).get('description', '')}")
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                errors.append(" ".join(str(arg.get("value", arg.get("description"))) for arg in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                errors.append(params["entry"]["text"])
        return errors


CHECK_PAGE = """(() => {
  const images = [...document.querySelectorAll("img.plot")];
  const table = [...document.querySelectorAll("h3")].find(h => h.textContent === "Hottest files")
                .nextElementSibling.querySelector("table");
  const header = [...table.tHead.rows[0].cells].find(cell => cell.textContent === "size");
  const sizes = () => [...table.tBodies[0].rows].map(row => parseFloat(row.cells[header.cellIndex].dataset.v));
  header.click();
  const descending = sizes();
  header.click();
  return {images: images.length, decoded: images.filter(i => i.complete && i.naturalWidth > 0).length,
          descending: descending, ascending: sizes(), arrow: header.getAttribute("aria-sort")};
})()"""


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_report_opens_in_headless_chromium(report_dir, tmp_path):
    from PIL import Image  # pillow comes with matplotlib

    profile = tempfile.mkdtemp(dir=tmp_path)
    browser = DevTools(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
                        "--window-size=1400,3000", "about:blank"])
    try:
        target = next(t for t in browser.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        session = browser.call("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            browser.call(f"{domain}.enable", session=session)
        browser.call("Page.navigate", {"url": "file://" + os.path.join(report_dir, "report.html")}, session=session)
        browser.wait_for("Page.loadEventFired")
        checks = browser.call("Runtime.evaluate", {"expression": CHECK_PAGE, "returnByValue": True},
                              session=session)["result"]["value"]
        shot = base64.b64decode(browser.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"])
        errors = browser.console_errors()
    finally:
        browser.close()
    assert errors == []
    assert checks["images"] == 2 + 2 * PLOTS_PER_LAYER and checks["decoded"] == checks["images"]
    assert checks["descending"] == sorted(checks["descending"], reverse=True)
    assert checks["ascending"] == sorted(checks["ascending"]) != checks["descending"]
    assert checks["arrow"] == "ascending"
    path = tmp_path / "screenshot.png"
    path.write_bytes(shot)
    with Image.open(path) as image:
        assert image.size[0] == 1400
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 100  # plots and text, not a blank page


def test_trace_ls_and_show(layers, traces):
    result = run("trace", "ls", traces)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].split()[:3] == ["TRACE", "LAYER", "ROLE"] and len(lines) == 17
    assert any("base-1.dtr" in line and layers.base.digest[:12] in line and "kernel" in line for line in lines)
    listed = json.loads(run("trace", "ls", traces, "--json").output)
    fuse = next(row for row in listed if row["path"].endswith("base-0.dtr"))
    assert fuse["records"] == len(WORKLOAD) and fuse["misses"] == 4 and fuse["wait_ms"] == 1.7

    result = run("trace", "show", os.path.join(traces, "base-0.dtr"), "--limit", "3", "--store", layers.store.url)
    assert result.exit_code == 0
    assert f"layer        {layers.base.digest}" in result.output
    assert "/bin/tool@0+131072" in result.output and "4 more" in result.output
    kernel = run("trace", "show", os.path.join(traces, "base-1.dtr"), "--store", layers.store.url, "--limit", "0")
    assert "-B--" in kernel.output and "MB--" in kernel.output and "/etc/conf@0+100" in kernel.output


def test_corrupt_traces_are_named_with_their_record(layers, traces, tmp_path):
    data = open(os.path.join(traces, "base-0.dtr"), "rb").read()
    bad_flags = tmp_path / "flags.dtr"
    record_2 = len(data) - (len(WORKLOAD) - 2) * RECORD.size
    bad_flags.write_bytes(data[:record_2 + 36] + b"\x80" + data[record_2 + 37:])
    result = run("trace", "report", str(bad_flags), "-o", str(tmp_path / "out"), "--store", layers.store.url)
    assert result.exit_code == 3
    assert f"{bad_flags}: trace record 2" in result.output and "unknown flags" in result.output

    short_header = tmp_path / "header.dtr"
    short_header.write_bytes(data[:20])
    result = run("trace", "report", str(short_header), "-o", str(tmp_path / "out"), "--store", layers.store.url)
    assert result.exit_code == 3 and f"{short_header}: trace header" in result.output

    listed = run("trace", "ls", str(bad_flags), os.path.join(traces, "base-0.dtr"))
    assert listed.exit_code == 3 and "base-0.dtr" in listed.output and "flags.dtr: trace record 2" in listed.output

    # A trace cut inside a record (the writer crashed) is reported on, with a note naming it and the record.
    cut = tmp_path / "cut.dtr"
    cut.write_bytes(data[:-7])
    result = run("trace", "report", str(cut), "-o", str(tmp_path / "out"), "--store", layers.store.url)
    assert result.exit_code == 0
    assert f"{cut} (record {len(WORKLOAD) - 1})" in result.output


def test_prefetch_build(layers, traces, tmp_path):
    paths = [os.path.join(traces, f"base-{i}.dtr") for i in range(8)]
    out = tmp_path / "base.prefetch"
    result = run("prefetch", "build", *paths, "-o", str(out), "--store", layers.store.url, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    plist = load(out)
    assert summary["chunks"] == len(plist.entries) == 12 and plist.traces == 8
    plist.verify(layers.base.blob_map, layer=layers.base.digest)
    mixed = run("prefetch", "build", traces, "-o", str(out), "--store", layers.store.url)
    assert mixed.exit_code == 2 and "more than one layer" in mixed.output


def test_a_report_of_traces_that_read_nothing_renders(layers, tmp_path):
    from lazy_fetch.analysis import analyze
    from lazy_fetch.report_html import render_html

    paths = [write_trace(tmp_path / f"{i}.dtr", layers.base, []) for i in range(2)]
    page = render_html(analyze(paths, layers.store))
    assert len(_images(page)) == 2 + PLOTS_PER_LAYER


def test_every_layer_section_is_open_and_each_layer_has_its_own_scale(layers, tmp_path):
    """Four layers (their sections used to start folded beyond three), one of them read in large part: its
    panel of the read-fraction plot must not set the scale of the others."""
    from lazy_fetch.analysis import analyze
    from lazy_fetch.report_html import _fraction_figure, render_html
    from tests.lazy_fetch.analysis_support import _build

    small = [_build(tmp_path, layers.store, f"small{i}", {"f": bytes([i + 1]) * 3000}, f"small/{i}:1", {})
             for i in range(2)]
    paths = [write_trace(tmp_path / f"base{i}.dtr", layers.base, WORKLOAD, ref="base/test:1", started_ns=i)
             for i in range(3)]
    paths += [write_trace(tmp_path / f"small{i}.dtr", layer, [Read("f", 0, 3000, 100)], role="toolkit",
                          ref=f"small/{i}:1") for i, layer in enumerate(small)]
    paths.append(write_trace(tmp_path / "ws.dtr", layers.workspace, [Read("work/main.py", 0, 3000, 100)],
                             role="workspace", ref="ws/repo:1"))
    report = analyze(paths, layers.store)
    assert len(report.layers) == 4
    page = render_html(report)
    assert page.count('<details class="layer" open>') == 4

    figure = _fraction_figure(report)
    tops = {ax.get_title(): ax.get_ylim()[1] for ax in figure.axes if ax.get_visible()}
    by_name = {layer.name: layer for layer in report.layers}
    assert set(tops) == set(by_name)
    for name, layer in by_name.items():
        most = max(max(s.byte_fraction, s.file_fraction) for s in report.traces if s.layer == layer.layer) * 100
        assert most <= tops[name] <= max(most, 10) * 1.1 + 1e-9, name  # scaled to its own layer
    assert tops["small/0:1"] == pytest.approx(110) and tops["ws/repo:1"] < 50  # read whole; read little


def test_a_figure_drawn_again_shows_only_the_layer_drawn_last(layers, tmp_path, monkeypatch):
    """The report draws each kind of plot on one figure, layer after layer: drawing layer A, then B, then A
    again gives A's picture byte for byte, as the first drawing on a new figure did."""
    from lazy_fetch import report_html
    from lazy_fetch.analysis import analyze

    paths = [write_trace(tmp_path / f"base{i}.dtr", layers.base, WORKLOAD, mode="kernel" if i % 2 else "fuse",
                         ref="base/test:1", started_ns=i) for i in range(3)]
    paths += [write_trace(tmp_path / f"ws{i}.dtr", layers.workspace, [Read("work/main.py", 0, 3000, 100)],
                          role="workspace", ref="ws/repo:1", started_ns=i) for i in range(2)]
    base, workspace = analyze(paths, layers.store).layers
    monkeypatch.setattr(report_html, "_FIGURES", report_html._FigurePool())  # none drawn by an earlier test
    for plot in (report_html._cold_start_plot, report_html._timeline_plot, report_html._waits_and_sizes_plot,
                 report_html._chunk_plot, report_html._prefetch_plot):
        first = plot(base)
        other = plot(workspace)
        assert plot(base) == first != other, plot.__name__
