"""``dsecfs daemon`` (the node daemon) and the commands that talk to it: ``mount``, ``umount``, ``status``,
``cache stats|evict``, ``prefetch start``.

cli/main.py registers them by name in its LazyCommands (this module is imported when a command line
names one of them), and adds ``prefetch_start`` to trace_cmds.prefetch when ``prefetch`` is loaded.

Every command but ``daemon`` is a call through dsec_fs.client.Node; ``mount`` starts a daemon (with its
--state-dir and --cache-dir, which the environment and the configuration file set as they set the
daemon's own, its log in the state directory) when none answers on the socket.

``daemon`` is where the node daemon is composed: lazy_fetch's NodeDaemon, extended with overlay's
sandboxes (overlay.node_service.attach), so that lazy_fetch imports nothing above it.
"""

from __future__ import annotations

import functools
import logging

import click

from dsec_fs.api import BINDINGS, DEFAULT_FILL, FILLS, MODES
from dsec_fs.client import (CACHE_DIR_ENV, DEFAULT_CACHE_DIR, DEFAULT_SOCKET, DEFAULT_STATE_DIR, SOCKET_ENV,
                             STATE_DIR_ENV, Node)
from dsec_fs.units import human_size, parse_size

from .common import Duration, emit, json_option, store_option

RUNTIMES = ("runc", "namespaces")  # overlay.runtime's

socket_option = click.option("--socket", "socket_path", envvar=SOCKET_ENV, default=DEFAULT_SOCKET, show_default=True,
                             metavar="PATH", help="the daemon's API socket")
state_dir_option = click.option("--state-dir", envvar=STATE_DIR_ENV, default=DEFAULT_STATE_DIR, show_default=True,
                                metavar="DIR", help="the daemon's mount state, FUSE session, traces (traces/)")
cache_dir_option = click.option("--cache-dir", envvar=CACHE_DIR_ENV, default=DEFAULT_CACHE_DIR, show_default=True,
                                metavar="DIR", help="the daemon's chunk cache")


@click.command()
@socket_option
@state_dir_option
@cache_dir_option
@click.option("--cache-size", default="10GiB", show_default=True, metavar="SIZE", help="bound of the chunk cache")
@click.option("--memory-cache", default="64MiB", show_default=True, metavar="SIZE",
              help="in-memory cache of recently read chunks")
@store_option
@click.option("--fuse-binding", type=click.Choice(BINDINGS), default="raw", show_default=True,
              help="raw: the daemon speaks /dev/fuse itself, and its mounts survive its restarts; pyfuse3 or "
                   "fusepy: through libfuse, and its mounts die with it")
@click.option("--latency", type=float, default=None, metavar="MS",
              help="emulate a remote store: add MS milliseconds to every store request")
@click.option("--bandwidth", default=None, metavar="SIZE",
              help="emulate a remote store: a shared link of SIZE per second (e.g. 100MB: 10^8 bytes)")
@click.option("--fetch-timeout", type=float, default=30.0, show_default=True, metavar="SECONDS",
              help="a store read that takes longer fails (the reader gets EIO)")
@click.option("--miss-readahead", default="4MiB", show_default=True, metavar="SIZE",
              help="a read that misses the cache also fetches more of its file while it is read in order, and, "
                   "while a reader walks files stored one after another, up to SIZE of the chunks after them, in "
                   "the same requests (0: fetch only what is read)")
@click.option("--read-ahead", default="1MiB", show_default=True, metavar="SIZE",
              help="how far the kernel reads ahead in a layer's files, in one request to the daemon (0: the "
                   "kernel's default, 128KiB)")
@click.option("--no-trace", is_flag=True, help="do not write access traces")
@click.option("--metrics-address", default=None, metavar="HOST:PORT",
              help="also serve /metrics (and nothing else of the API) over TCP here, for Prometheus "
                   "(e.g. 127.0.0.1:9402; off by default)")
@click.option("--no-profiles", is_flag=True,
              help="do not learn access profiles from traces, share them through the store, or prefetch by them")
@click.option("--profile-every", type=Duration(), default="10m", show_default=True, metavar="DURATION",
              help="while a layer stays mounted, also publish its access profile this often, from what was read so "
                   "far, so long runs are learned from before they end (0: only when the mount ends)")
@click.option("--fill", type=click.Choice(FILLS), default=DEFAULT_FILL, show_default=True,
              help="what a new mount fetches in the background: nothing, its profile, or that and then the rest "
                   "of the layer (until the cache bound); auto: its profile if it has one, else the whole layer; "
                   "mounts and sandboxes may say otherwise")
@click.option("--trace-keep-size", default="1GiB", show_default=True, metavar="SIZE",
              help="closed traces beyond this size in all are removed, oldest first")
@click.option("--trace-keep-age", type=Duration(), default="7d", show_default=True, metavar="DURATION",
              help="closed traces older than this are removed")
@click.option("--ref-ttl", type=Duration(), default="15s", show_default=True, metavar="DURATION",
              help="use a ref read from the store for this long (refs move, the layers they name do not; 0: read it "
                   "every time)")
@click.option("--meta-cache-size", default="512MiB", show_default=True, metavar="SIZE",
              help="keep layer metadata (manifests, meta.erofs, blob maps, pack indexes) in the cache directory up to "
                   "this size, so a layer opens again without the store (0: do not)")
@click.option("--idle-grace", type=Duration(), default="60s", show_default=True, metavar="DURATION",
              help="a sandbox layer no sandbox uses stays mounted this long, for the next `sandbox up` (0: unmount it "
                   "at once)")
@click.option("--log-file", default=None, metavar="PATH", help="log here instead of stderr")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option("--sandbox-layer-mode", type=click.Choice(MODES), default="kernel", show_default=True,
              help="how the layers of sandboxes are mounted")
@click.option("--sandbox-runtime", type=click.Choice(RUNTIMES), default="runc", show_default=True,
              help="what runs sandbox commands unless `sandbox exec --runtime` says otherwise")
def daemon(socket_path: str, state_dir: str, cache_dir: str, cache_size: str, memory_cache: str,
           store_url: str | None, fuse_binding: str, latency: float | None, bandwidth: str | None,
           fetch_timeout: float, miss_readahead: str, read_ahead: str, no_trace: bool, metrics_address: str | None,
           no_profiles: bool, profile_every: float, fill: str, ref_ttl: float, meta_cache_size: str,
           idle_grace: float, trace_keep_size: str, trace_keep_age: float, log_file: str | None, log_level: str,
           sandbox_layer_mode: str, sandbox_runtime: str) -> None:
    """Run the node daemon: mounts layers, fetches and caches chunks, runs sandboxes, serves the API on the
    socket.

    SIGTERM or SIGINT stops the sandboxes (keeping their changes), unmounts everything and stops. Store
    faults for tests come from $DSECFS_FAULTS (FaultStore rules)."""
    from lazy_fetch.daemon import DaemonOptions, run_daemon
    from overlay import node_service

    logging.basicConfig(level=log_level.upper(), filename=log_file,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = DaemonOptions(
        socket_path=socket_path, state_dir=state_dir, cache_dir=cache_dir, cache_bytes=parse_size(cache_size),
        memory_cache_bytes=parse_size(memory_cache), store_url=store_url, fuse_binding=fuse_binding,
        latency=None if latency is None else latency / 1000,
        bandwidth=None if bandwidth is None else parse_size(bandwidth),
        fetch_timeout=fetch_timeout, miss_readahead_bytes=parse_size(miss_readahead),
        read_ahead_bytes=parse_size(read_ahead), trace=not no_trace, metrics_address=metrics_address,
        profiles=not no_profiles, profile_publish_seconds=profile_every, fill=fill, ref_ttl=ref_ttl,
        meta_cache_bytes=parse_size(meta_cache_size), idle_grace=idle_grace,
        trace_keep_bytes=parse_size(trace_keep_size),
        trace_keep_seconds=trace_keep_age)
    sandboxes = functools.partial(node_service.attach, layer_mode=sandbox_layer_mode, runtime=sandbox_runtime)
    run_daemon(options, extensions=[sandboxes])


@click.command()
@click.argument("layer")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.option("--mode", type=click.Choice(MODES), default="kernel", show_default=True,
              help="kernel: the kernel's EROFS driver over a FUSE blob file; fuse: the whole tree over FUSE")
@click.option("--prefetch", "prefetch_list", default=None, metavar="LIST",
              type=click.Path(exists=True, dir_okay=False, path_type=str),
              help="a prefetch list (dsecfs prefetch build) to fetch in the background, instead of the profile")
@click.option("--no-profile", is_flag=True, help="do not prefetch by the layer's access profile from the store")
@click.option("--fill", type=click.Choice(FILLS), default=None, help="auto, none, profile or layer (default: the daemon's)")
@store_option
@click.option("--fuse-binding", type=click.Choice(BINDINGS), default=None,
              help="the FUSE binding of a daemon this command starts (and that a running one must use)")
@socket_option
@state_dir_option
@cache_dir_option
@json_option
def mount(layer: str, directory: str, mode: str, prefetch_list: str | None, no_profile: bool, fill: str | None,
          store_url: str | None, fuse_binding: str | None, socket_path: str, state_dir: str, cache_dir: str,
          as_json: bool) -> None:
    """Mount LAYER (a ref, a digest or a digest prefix) at DIRECTORY through the node daemon (one is started,
    with --state-dir and --cache-dir, if none answers). Unless --prefetch or --no-profile, what sandboxes
    read of the layer before (its access profile, shared through the store) is fetched in the background,
    first-needed first."""
    node = Node.ensure_running(socket_path, store=store_url, fuse_binding=fuse_binding, state_dir=state_dir,
                               cache_dir=cache_dir)
    info = node.mount(layer, directory, mode=mode, store=store_url, prefetch_list=prefetch_list,
                      fuse_binding=fuse_binding, profile=not no_profile, fill=fill)
    emit(as_json, info, lambda: f"mounted {info.ref} ({info.layer[:12]}) at {info.mountpoint}, {info.mode} "
                                       f"mode" + (f"; trace {info.trace}" if info.trace else ""),
         result=info.mountpoint)


@click.command()
@click.argument("directory", type=click.Path(path_type=str))
@click.option("--lazy", is_flag=True, help="detach even if busy; files open on it keep working")
@socket_option
@json_option
def umount(directory: str, lazy: bool, socket_path: str, as_json: bool) -> None:
    """Unmount a layer the node daemon mounted at DIRECTORY."""
    import os

    Node(socket_path).umount(directory, lazy=lazy)
    mountpoint = os.path.abspath(directory)
    emit(as_json, {"mountpoint": mountpoint, "lazy": lazy}, lambda: f"unmounted {mountpoint}")


@click.command()
@socket_option
@json_option
def status(socket_path: str, as_json: bool) -> None:
    """The node daemon: its mounts, layers, cache and prefetches."""
    st = Node(socket_path).status()

    def text() -> str:
        cache = st.cache
        lines = [f"daemon   pid {st.pid}, dsecfs {st.version}, since {st.started}, FUSE {st.fuse_binding}",
                 f"socket   {st.socket}", f"state    {st.state_dir}", f"store    {st.store}",
                 f"cache    {human_size(cache.bytes)} of {human_size(cache.max_bytes)} in {cache.entries:,} chunks, "
                 f"{cache.hits:,} hits, {cache.misses:,} misses (memory: {human_size(cache.memory_bytes)}, "
                 f"{cache.memory_hits:,} hits)"]
        if st.cleaned:
            lines.append(f"cleaned  {', '.join(st.cleaned)} (left by a daemon that died)")
        lines.append(f"\n{'MOUNTPOINT':<40} {'MODE':<6} {'LAYER':<12} {'REF':<24} PREFETCHED BY")
        lines += [f"{m.mountpoint:<40} {m.mode:<6} {m.layer[:12]:<12} {m.ref:<24} "
                  f"{m.prefetch or '-'}{' ' + m.profile_key if m.profile_key else ''}"
                  + (f" (idle, unmounted at {m.idle_until})" if m.idle_until else "") for m in st.mounts]
        lines.append(f"\n{'LAYER':<12} {'MOUNTS':>6} {'USED':>7} {'FETCHED':>10} {'CHUNKS':>7} {'ERRORS':>6}")
        lines += [f"{layer.layer[:12]:<12} {layer.mounts:>6} {layer.fetched_ratio * 100:>6.1f}% "
                  f"{human_size(layer.bytes_fetched):>10} {layer.chunks_fetched:>7,} {layer.fetch_errors:>6,}"
                  for layer in st.layers]
        lines += [f"predicted {layer.layer[:12]}: prefetched {human_size(layer.prefetched_bytes)}, of which read "
                  f"{human_size(layer.prefetched_read_bytes)}, never read {human_size(layer.prefetched_unread_bytes)}; "
                  f"read, not prefetched {human_size(layer.read_not_prefetched_bytes)}"
                  for layer in st.layers if layer.prefetched_bytes]
        lines += [f"prefetch {p.layer[:12]} {p.state}: {p.done_chunks:,}/{p.chunks:,} chunks, "
                  f"{human_size(p.done_bytes)}, {p.failed_chunks} failed" for p in st.prefetches]
        return "\n".join(lines)

    emit(as_json, st, text)


@click.group()
def cache() -> None:
    """The node daemon's chunk cache."""


@cache.command("stats")
@socket_option
@json_option
def cache_stats(socket_path: str, as_json: bool) -> None:
    """Size, entries, hits and misses of the chunk cache (disk and memory)."""
    info = Node(socket_path).cache_stats()
    emit(as_json, info, lambda: _cache_text(info))


@cache.command("evict")
@click.option("--to", "to_size", default="0", show_default=True, metavar="SIZE",
              help="evict least recently used chunks until at most SIZE stay")
@socket_option
@json_option
def cache_evict(to_size: str, socket_path: str, as_json: bool) -> None:
    """Evict chunks from the cache (disk and memory)."""
    info = Node(socket_path).cache_evict(parse_size(to_size))
    emit(as_json, info, lambda: f"evicted {info.evicted:,} chunks\n" + _cache_text(info))


def _cache_text(info) -> str:
    return "\n".join([
        f"directory  {info.directory}",
        f"size       {human_size(info.bytes)} of {human_size(info.max_bytes)}, {info.entries:,} chunks",
        f"lookups    {info.hits:,} hits, {info.misses:,} misses, {info.evictions:,} evicted, {info.rotten:,} rotten",
        f"memory     {human_size(info.memory_bytes)} of {human_size(info.memory_max_bytes)}, {info.memory_entries:,} chunks, "
        f"{info.memory_hits:,} hits, {info.memory_misses:,} misses",
    ])


@click.command("start")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("prefetch_list", metavar="LIST", type=click.Path(exists=True, dir_okay=False, path_type=str))
@socket_option
@json_option
def prefetch_start(directory: str, prefetch_list: str, socket_path: str, as_json: bool) -> None:
    """Fetch LIST in the background for the layer the node daemon mounted at DIRECTORY."""
    info = Node(socket_path).prefetch(directory, prefetch_list)
    emit(as_json, info, lambda: f"prefetching {info.chunks:,} chunks ({human_size(info.bytes)}) of layer "
                                       f"{info.layer[:12]}")
