"""A served blob's trace, in segments: opened for a label of its holders (trace_holders.py), ended when
the label changes or the blob's last mount goes, and the profiles learned from it published.

    segments = TraceSegments(trace_dir, enabled=True, profiles=keeper, background=lambda: nursery)
    path, writer = segments.open(files, mode, blob, label, prefetch=..., profile_key=...)
    segments.relabel(served)   # after its holders changed: a new segment if their label did
    segments.end(served)       # its last mount went: the layer's profile from every segment

What is published (profile_keeper.py, best effort, in tasks of ``background()``; None: at its flush):
when a segment that one combination's sandboxes alone held ends, its profile under that combination;
when the trace ends, the layer's (and its ref name's) from all segments joined as one trace; and, for a
long run, both of those from what the trace holds so far, every ``publish_every`` seconds of the run
(``publish_running``, called by the daemon as it flushes the traces).

Threads: the daemon's trio thread (it owns the Served records); opening a file is a short local write.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable

import trio

from dsec_fs.files import unlink_if_present
from dsec_fs.layer import LayerFiles

from .blob_reader import LayerBlob
from .profile_keeper import ProfileKeeper, PublishedRun
from .served_layers import Served
from .trace import TRACE_SUFFIX, TraceHeader, TraceWriter
from .trace_holders import Label

log = logging.getLogger(__name__)


class TraceSegments:
    def __init__(self, trace_dir: str, *, enabled: bool, profiles: ProfileKeeper | None,
                 background: Callable[[], trio.Nursery | None]):
        self.trace_dir = trace_dir
        self.enabled = enabled
        self.profiles = profiles
        self._background = background

    def open(self, files: LayerFiles, mode: str, blob: LayerBlob, label: Label, *, prefetch: str = "",
             profile_key: str = "") -> tuple[str, TraceWriter | None]:
        """A new trace (or segment) of ``files`` in ``mode`` for ``label``'s holders, from when they came;
        ("", None) when tracing is off."""
        if not self.enabled:
            return "", None
        stats = files.manifest.stats
        holder = label.holder
        started_ns = time.time_ns() - max(0, time.monotonic_ns() - label.since_ns)
        header = TraceHeader(layer=files.digest, ref=holder.ref, role=holder.role, combination=label.combination,
                             holders=label.holders, prefetch=prefetch, profile_key=profile_key, mode=mode,
                             chunk_size=files.manifest.chunk_size, layer_bytes=int(stats.get("bytes", 0)),
                             layer_files=int(stats.get("files", 0)), blob_bytes=blob.size, started_ns=started_ns)
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{files.digest[:12]}-{mode}-{secrets.token_hex(3)}{TRACE_SUFFIX}"
        path = os.path.join(self.trace_dir, name)
        try:
            return path, TraceWriter(path, header, start_ns=label.since_ns)
        except OSError as exc:  # a full disk (the sandboxes' upper dirs share it): the mount goes untraced
            log.error("cannot start the trace %s: %s; the mount's reads go untraced", path, exc.strerror or exc)
            unlink_if_present(path)
            return "", None

    def relabel(self, served: Served) -> None:
        """When the labels of ``served``'s holders changed, its trace goes on in a new segment; when no one
        holds it (an idle mount: overlay/node_service.py keeps a sandbox layer mounted for a grace after
        its last ``down``), the segment ends, and the next holder starts one."""
        label = served.holders.label()
        if label is None and served.label is None or label is not None and label.same(served.label):
            return
        mode = served.mode
        if served.trace_path:
            self._end_segment(served)
            served.segments.append(served.trace_path)
            served.trace_path = ""
            served.segment_run = PublishedRun()
        if label is not None:
            layer = served.layer
            served.trace_path, served.blob.trace = self.open(layer.files, mode, layer.blob, label)
        served.label = label

    def end(self, served: Served) -> None:
        """Close ``served``'s trace and have its profiles published: the layer's, from every segment; the
        combination's, from the last segment if it was one combination's."""
        self._end_segment(served)
        self._publish_layer(served)

    def publish_running(self, served: list[Served], publish_every: float) -> None:
        """Publish, from what their traces hold so far, the profiles of the layers in ``served`` whose
        live trace has gone on ``publish_every`` seconds since it began or last published (their writers
        flushed: the daemon flushes every trace just before)."""
        if self.profiles is None or publish_every <= 0:
            return
        now = time.monotonic()
        for one in served:
            if one.trace_path and now - one.run.last >= publish_every:
                # Not while the run's previous publish is unfinished (a store that does not answer).
                self._publish_layer(one, if_idle=True)
                self._publish_combination(one, if_idle=True)

    def _publish_layer(self, served: Served, *, if_idle: bool = False) -> None:
        segments = [*served.segments, served.trace_path] if served.trace_path else served.segments
        if self.profiles is not None and segments:
            layer = served.layer
            self.profiles.publish_soon(self._background(), layer.store.store, layer.files, layer.index,
                                       segments, served.ref_name, run=served.run, if_idle=if_idle)

    def _publish_combination(self, served: Served, *, if_idle: bool = False) -> None:
        """If one combination's sandboxes alone hold the segment being written, publish its profile (so
        far) for that combination."""
        combination = served.label.combination if served.label is not None else ""
        if self.profiles is not None and served.trace_path and combination:
            layer = served.layer
            self.profiles.publish_soon(self._background(), layer.store.store, layer.files, layer.index,
                                       [served.trace_path], None, run=served.segment_run, combination=combination,
                                       if_idle=if_idle)

    def _end_segment(self, served: Served) -> None:
        """Close the segment being written, and publish it for its combination if it had one."""
        served.close_trace()
        self._publish_combination(served)
