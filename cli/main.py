"""The ``dsecfs`` command: thin, every command a call into the packages below.

Errors: a DsecError is printed as one line naming its kind and where it happened (under --json, one JSON
object on stdout: class, kind, message, where, exit_code), and the process exits with the error class's
own exit code (2 input, 3 corrupt, 4 unsupported, 5 unavailable, 6 not found, 7 conflict); Ctrl-C exits
130; anything else is a bug and keeps its traceback.

Options: every command has --json, -q and --log-level (cli/common.py); every option can also be set by
an environment variable (shown in --help: DSECFS_STORE, DSECFS_SOCKET, ... or DSECFS_<COMMAND>_<OPTION>)
and in the configuration file (cli/config.py).
"""

from __future__ import annotations

import json
import os
import sys

import click

from dsec_fs.errors import DsecError, InputError
from dsec_fs.store import open_store
from dsec_fs.units import human_size, parse_size

from . import oci_cmds
from .common import (CHUNK_SIZE_HELP, ENV_PREFIX, JSON_META, LazyCommands, add_common_options, emit, json_option,
                     note, store_option, store_to_publish_in)
from .config import CONFIG_ENV, DEFAULT_CONFIG, config_path, load_default_map
from .oci_cmds import registry_option, registry_options

ARGV_META = "dsecfs.argv"
SIGINT_EXIT = 130  # 128 + SIGINT, as shells report a command Ctrl-C stopped


class DsecGroup(click.Group):
    """Turns DsecError (and, under --json, click's usage errors) into one clear line or one JSON object and
    the error class's exit code; Ctrl-C into exit 130."""

    def parse_args(self, ctx, args):
        ctx.meta[ARGV_META] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DsecError as exc:
            _fail(ctx, type(exc).__name__, exc.kind, exc.message, exc.where, exc.exit_code)
        except click.ClickException as exc:
            if not _wants_json(ctx):
                raise
            _fail(ctx, type(exc).__name__, "usage", exc.format_message(), None, exc.exit_code)
        except KeyboardInterrupt:
            _fail(ctx, "KeyboardInterrupt", "interrupted", "interrupted", None, SIGINT_EXIT)


def _wants_json(ctx: click.Context) -> bool:
    argv = ctx.meta.get(ARGV_META, [])
    return bool(ctx.meta.get(JSON_META)) or "--json" in argv[:argv.index("--") if "--" in argv else None]


def _fail(ctx: click.Context, cls: str, kind: str, message: str, where: str | None, exit_code: int) -> None:
    if _wants_json(ctx):
        click.echo(json.dumps({"error": {"class": cls, "kind": kind, "message": message, "where": where,
                                         "exit_code": exit_code}}, indent=2, sort_keys=True))
    elif kind == "interrupted":
        click.echo("dsecfs: interrupted", err=True)
    else:
        click.echo(f"dsecfs: {kind} error: {f'{where}: {message}' if where else message}", err=True)
    sys.exit(exit_code)


@click.group(cls=DsecGroup, context_settings={"auto_envvar_prefix": ENV_PREFIX})
@click.option("--config", "config_file", envvar=CONFIG_ENV, metavar="FILE", show_envvar=True,
              help=f"the configuration file (default {DEFAULT_CONFIG} if it exists)")
@click.version_option(package_name="dsecfs")
@click.pass_context
def main(ctx: click.Context, config_file: str | None) -> None:
    """Layered EROFS images with content-addressed, lazily fetched chunks."""
    path = config_path(config_file)
    if path:
        ctx.default_map = load_default_map(main, path)


@main.command()
@click.argument("source", type=click.Path(path_type=str))
@store_option
@click.option("--name", "ref", metavar="NAME:TAG", help="publish the layer under this ref")
@click.option("--chunk-size", default="1MiB", show_default=True, help=CHUNK_SIZE_HELP)
@click.option("--parent", metavar="LAYER",
              help="an earlier build of SOURCE (ref or digest): files unchanged since (same inode, size, mtime "
                   "and ctime) are not read again")
@click.option("--lenient", is_flag=True, help="skip hostile tar members (with a warning) instead of failing")
@click.option("--platform", default="linux/amd64", show_default=True, help="which image of an OCI index")
@click.option("--oci-layers", is_flag=True,
              help="one layer per OCI image layer (refs NAME:TAG-l0, -l1, ...) with overlay whiteouts, "
                   "instead of one flattened layer")
@click.option("--max-size", default="256GiB", show_default=True,
              help="refuse a layer whose files add up to more (logical size: holes count)")
@click.option("--max-meta-size", default="256MiB", show_default=True,
              help="refuse a layer whose metadata (inodes, names, chunk indexes) would be larger")
@click.option("--tar-limit", "tar_limit", multiple=True, metavar="NAME=VALUE",
              help="raise a tar input limit: max_file_size, max_header_size, max_sparse_segments, "
                   "max_tar_bytes, max_expansion, expansion_allowance (repeatable)")
@registry_option
@json_option
def build(source: str, store_url: str | None, ref: str | None, chunk_size: str, parent: str | None,
          lenient: bool, platform: str, oci_layers: bool, max_size: str, max_meta_size: str,
          tar_limit: tuple[str, ...], plain_http: bool, as_json: bool) -> None:
    """Build SOURCE into a layer in the store.

    SOURCE is a directory, a tar file (plain, gzip or zstd; - for standard input), an OCI image layout
    directory, an OCI or docker-archive tar, oci:DIR:TAG (one image of a layout), or
    docker://HOST[:PORT]/REPO[:TAG|@DIGEST] (an image in a registry, streamed)."""
    from erofs_builder.build import build_image_layers, build_layer

    if oci_layers and parent:
        raise InputError("--parent builds a directory; --oci-layers builds an image: not both")
    from erofs_builder.limits import LayerLimits, tar_limits_with

    options = dict(name=ref, chunk_size=parse_size(chunk_size), lenient=lenient, platform=platform,
                   limits=LayerLimits(parse_size(max_size), parse_size(max_meta_size)),
                   tar_limits=tar_limits_with(list(tar_limit)),
                   # None: the defaults, without importing the registry client (http.client, ssl, ~40 ms)
                   registry=registry_options(plain_http))
    with store_to_publish_in(store_url) as store:
        def run(**extra):
            if oci_layers:
                return build_image_layers(source, store, **options, **extra)
            return [build_layer(source, store, parent=parent, **options, **extra)]

        if sys.stderr.isatty() and not as_json:
            with click.progressbar(length=1, label="building", file=sys.stderr, show_pos=False) as bar:
                def progress(done: int, total: int) -> None:
                    bar.length = max(total, 1)
                    bar.update(done - bar.pos)

                results = run(progress=progress)
        else:
            results = run()
    if oci_layers:
        data = {"layers": [{"layer": r.digest, "ref": f"{ref}-l{k}" if ref else None, "stats": r.manifest.stats}
                           for k, r in enumerate(results)], "store": store.url}
        emit(as_json, data, lambda: "\n".join(f"layer {k}  {r.digest}" + (f"  ({ref}-l{k})" if ref else "")
                                               for k, r in enumerate(results)),
             result="\n".join(r.digest for r in results))
        return
    result = results[0]
    stats = result.manifest.stats
    data = {"layer": result.digest, "ref": ref, "parent": parent, "store": store.url, "stats": stats}

    def text() -> str:
        return "\n".join([
            f"files        {stats['files']:>12,}",
            f"bytes        {human_size(stats['bytes']):>12}",
            f"chunks       {stats['chunks']:>12,}  ({stats.get('distinct_chunks', 0):,} distinct, "
            f"{stats.get('hole_chunks', 0):,} holes)",
            f"new          {human_size(stats['new_bytes']):>12}  in {stats['new_chunks']:,} chunks, "
            f"stored as {human_size(stats['stored_bytes'])}",
            f"deduplicated {human_size(stats['dedup_bytes']):>12}",
            *([f"not read     {human_size(stats['reused_bytes']):>12}  in {stats['reused_files']:,} files unchanged "
               f"since the parent"] if parent else []),
            f"layer        {result.digest}" + (f"  ({ref})" if ref else ""),
        ])

    emit(as_json, data, text, result=result.digest)


@main.command()
@click.argument("layer")
@store_option
@json_option
def inspect(layer: str, store_url: str | None, as_json: bool) -> None:
    """Show a layer: its files, chunks, what they take in the store and how much of that other layers share;
    its manifest (sizes, packs) and the figures of the build that made it."""
    from erofs_builder.layer_figures import layer_figures

    with open_store(store_url) as store:
        files, figures = layer_figures(store, layer)
    m = files.manifest
    data = {
        "layer": files.digest, "blob_id": m.blob_id, "chunk_size": m.chunk_size, "block_size": m.block_size,
        "meta_size": m.meta_size, "blobmap_size": m.blobmap_size, "blob_blocks": m.blob_blocks,
        "packs": m.packs, "created": m.created, "source": m.source, "figures": figures.to_dict(),
        "build_stats": m.stats,
    }

    def text() -> str:
        f = figures
        if f.shared_chunks:
            shared = (f"{f.shared_chunks:,} chunks ({human_size(f.shared_stored_bytes)} stored) with some of the "
                      f"{f.other_layers:,} other layers")
        else:
            shared = f"nothing with the {f.other_layers:,} other layers" if f.other_layers else "nothing (no others)"
        lines = [f"layer       {files.digest}", f"created     {m.created}", f"source      {m.source}",
                 f"files       {f.files:,} ({human_size(f.bytes)}), {f.entries:,} entries, {f.inodes:,} inodes",
                 f"chunks      {f.chunks:,} ({human_size(f.chunk_bytes)}), chunk size {human_size(m.chunk_size)}",
                 f"stored      {human_size(f.stored_bytes)} in {len(m.packs)} packs"
                 + (f", {f.missing_chunks:,} chunks in none of them" if f.missing_chunks else ""),
                 f"shared      {shared}; its own: {human_size(f.own_stored_bytes)}",
                 f"meta.erofs  {human_size(m.meta_size)}",
                 f"blob        {human_size(m.blob_blocks * m.block_size)} (virtual, id {m.blob_id[:16]}...)",
                 "built with  " + ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
                                            for k, v in sorted(m.stats.items()))]
        return "\n".join(lines)

    emit(as_json, data, text)


@main.command()
@click.argument("layer")
@store_option
@click.option("--metadata-only", is_flag=True, help="skip fetching and hashing every chunk")
@json_option
def fsck(layer: str, store_url: str | None, metadata_only: bool, as_json: bool) -> None:
    """Check a layer: metadata structures, and every referenced chunk present and hashing right."""
    from erofs_builder.fsck import fsck_layer

    with open_store(store_url) as store:
        report = fsck_layer(store, layer, check_chunks=not metadata_only)
    data = report.to_dict()
    emit(as_json, data, report.summary)
    if not report.ok:
        sys.exit(3)


@main.command()
@click.argument("layer")
@click.argument("out_dir", type=click.Path(path_type=str))
@store_option
@json_option
def export(layer: str, out_dir: str, store_url: str | None, as_json: bool) -> None:
    """Write OUT_DIR/meta.erofs and OUT_DIR/blob (the materialised virtual blob)."""
    from dsec_fs.layer import resolve
    from erofs_builder.export import export_layer

    with open_store(store_url) as store:
        digest = resolve(store, layer)
        export_layer(store, digest, out_dir)
    meta, blob = (os.path.join(os.path.abspath(out_dir), name) for name in ("meta.erofs", "blob"))
    emit(as_json, {"layer": digest, "store": store.url, "meta": meta, "blob": blob},
         lambda: f"mount with: device={blob} {meta}")


@main.command()
@click.argument("layer")
@click.argument("out_dir", type=click.Path(path_type=str))
@store_option
@click.option("--keep-privileged", is_flag=True,
              help="as root, also recreate setuid/setgid bits, device nodes and file capabilities, as tar -p "
                   "does (left out by default)")
@json_option
def extract(layer: str, out_dir: str, store_url: str | None, keep_privileged: bool, as_json: bool) -> None:
    """Recreate the layer's tree in OUT_DIR (must be empty or absent)."""
    from dsec_fs.layer import resolve
    from erofs_builder.export import extract_layer

    with open_store(store_url) as store:
        digest = resolve(store, layer)
        stats = extract_layer(store, digest, out_dir, keep_privileged=keep_privileged or None)
    dropped = {kind: count for kind, count in stats.dropped.to_dict().items() if count}
    if dropped:
        note("left out (--keep-privileged keeps them): " + ", ".join(f"{count} {kind}" for kind, count in dropped.items()))
    directory = os.path.abspath(out_dir)
    emit(as_json, {"layer": digest, "store": store.url, "directory": directory, "dropped": dropped},
         lambda: f"extracted layer {digest[:12]} into {directory}")


@main.command("mount-export")
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("mountpoint", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("command", nargs=-1, required=True)
def mount_export(export_dir: str, mountpoint: str, command: tuple[str, ...]) -> None:
    """Mount an exported layer with the kernel's EROFS driver, run COMMAND, unmount; exits with COMMAND's
    exit code (its output is its own, also under --json).

    util-linux mount would put meta.erofs on a loop device and then refuse a regular file as device=,
    so this calls mount(2) itself (file-backed EROFS).
    """
    import subprocess

    from dsec_fs.mounts import mounted_erofs

    meta = os.path.join(export_dir, "meta.erofs")
    blob = os.path.join(export_dir, "blob")
    with mounted_erofs(meta, mountpoint, [blob]):
        rc = subprocess.run(list(command)).returncode
    sys.exit(rc)


main.add_command(oci_cmds.convert)
main.add_command(oci_cmds.snapshotter)
main.add_command(oci_cmds.image)
add_common_options(main)


def _prefetch() -> click.Group:
    from . import daemon_cmds, trace_cmds
    trace_cmds.prefetch.add_command(daemon_cmds.prefetch_start)
    return trace_cmds.prefetch


# The commands of the other modules are imported when a command line names them (or when every command is
# listed: --help, a configuration file): `dsecfs build` does not import the daemon's client and API types,
# the sandbox, trace and scheduler commands (~30 ms of a build's start, docs/benchmarks.md, issue 17).
main.commands = LazyCommands(main.commands, {
    "diff": ("diff_cmds", "diff"), "sched": ("sched_cmds", "sched"), "trace": ("trace_cmds", "trace"),
    "prefetch": _prefetch, "gc": ("store_cmds", "gc_command"), "store": ("store_cmds", "store_group"),
    "daemon": ("daemon_cmds", "daemon"), "mount": ("daemon_cmds", "mount"), "umount": ("daemon_cmds", "umount"),
    "status": ("daemon_cmds", "status"), "cache": ("daemon_cmds", "cache"), "sandbox": ("sandbox_cmds", "sandbox"),
    "ref": ("ref_cmds", "ref"),
})

if __name__ == "__main__":
    main()
