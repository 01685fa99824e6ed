"""The ``dsecfs`` command: thin, every command a call into the packages below.

Errors: a DsecError is printed as one line naming its kind and where it happened, and the process exits
with the error class's own exit code (2 input, 3 corrupt, 4 unsupported, 5 unavailable, 6 not found,
7 conflict); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys

import click

from dsec_fs.errors import DsecError, InputError
from dsec_fs.store import open_store
from dsec_fs.units import human_size, parse_size

from . import daemon_cmds, diff_cmds, oci_cmds, sandbox_cmds, sched_cmds, store_cmds, trace_cmds
from .common import CHUNK_SIZE_HELP, emit, json_option, store_option
from .oci_cmds import plain_http_option, registry_options

class DsecGroup(click.Group):
    """Turns DsecError into one clear line and the error class's exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DsecError as exc:
            click.echo(f"dsecfs: {exc.kind} error: {exc}", err=True)
            sys.exit(exc.exit_code)


@click.group(cls=DsecGroup)
@click.version_option(package_name="dsecfs")
def main() -> None:
    """Layered EROFS images with content-addressed, lazily fetched chunks."""


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
@plain_http_option
@json_option
def build(source: str, store_url: str | None, ref: str | None, chunk_size: str, parent: str | None,
          lenient: bool, platform: str, oci_layers: bool, plain_http: bool, as_json: bool) -> None:
    """Build SOURCE into a layer in the store.

    SOURCE is a directory, a tar file (plain, gzip or zstd; - for standard input), an OCI image layout
    directory, an OCI or docker-archive tar, oci:DIR:TAG (one image of a layout), or
    docker://HOST[:PORT]/REPO[:TAG|@DIGEST] (an image in a registry, streamed)."""
    from erofs_builder.build import build_image_layers, build_layer

    if oci_layers and parent:
        raise InputError("--parent builds a directory; --oci-layers builds an image: not both")
    options = dict(name=ref, chunk_size=parse_size(chunk_size), lenient=lenient, platform=platform,
                   registry=registry_options(plain_http))
    with open_store(store_url) as store:
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
                                               for k, r in enumerate(results)))
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

    emit(as_json, data, text)


@main.command()
@click.argument("layer")
@store_option
@json_option
def inspect(layer: str, store_url: str | None, as_json: bool) -> None:
    """Show a layer's manifest: sizes, chunk statistics, packs."""
    from dsec_fs.layer import open_layer
    from erofs_builder.reader import ErofsImage

    with open_store(store_url) as store:
        files = open_layer(store, layer)
    image = ErofsImage(files.meta, source=f"layer {files.digest[:12]} meta.erofs")
    m = files.manifest
    data = {
        "layer": files.digest, "blob_id": m.blob_id, "chunk_size": m.chunk_size, "block_size": m.block_size,
        "meta_size": m.meta_size, "blobmap_size": m.blobmap_size, "blob_blocks": m.blob_blocks,
        "packs": m.packs, "stats": m.stats, "created": m.created, "source": m.source,
        "inodes": image.superblock.inos,
    }

    def text() -> str:
        lines = [f"layer       {files.digest}", f"created     {m.created}", f"source      {m.source}",
                 f"inodes      {image.superblock.inos:,}", f"meta.erofs  {human_size(m.meta_size)}",
                 f"blob        {human_size(m.blob_blocks * m.block_size)} (virtual, id {m.blob_id[:16]}...)",
                 f"chunk size  {human_size(m.chunk_size)}", f"packs       {len(m.packs)}"]
        lines += [f"  {k:<16}{v:,}" if isinstance(v, int) else f"  {k:<16}{v}" for k, v in sorted(m.stats.items())]
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
def export(layer: str, out_dir: str, store_url: str | None) -> None:
    """Write OUT_DIR/meta.erofs and OUT_DIR/blob (the materialised virtual blob)."""
    from erofs_builder.export import export_layer

    with open_store(store_url) as store:
        export_layer(store, layer, out_dir)
    click.echo(f"mount with: device={os.path.join(os.path.abspath(out_dir), 'blob')} "
               f"{os.path.join(os.path.abspath(out_dir), 'meta.erofs')}")


@main.command()
@click.argument("layer")
@click.argument("out_dir", type=click.Path(path_type=str))
@store_option
def extract(layer: str, out_dir: str, store_url: str | None) -> None:
    """Recreate the layer's tree in OUT_DIR (must be empty or absent)."""
    from erofs_builder.export import extract_layer

    with open_store(store_url) as store:
        extract_layer(store, layer, out_dir)


@main.command("mount-export")
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("mountpoint", type=click.Path(exists=True, file_okay=False, path_type=str))
@click.argument("command", nargs=-1, required=True)
def mount_export(export_dir: str, mountpoint: str, command: tuple[str, ...]) -> None:
    """Mount an exported layer with the kernel's EROFS driver, run COMMAND, unmount.

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


main.add_command(diff_cmds.diff)
main.add_command(sched_cmds.sched)
main.add_command(trace_cmds.trace)
main.add_command(trace_cmds.prefetch)
main.add_command(store_cmds.gc_command)
main.add_command(store_cmds.store_group)
main.add_command(daemon_cmds.daemon)
main.add_command(daemon_cmds.mount)
main.add_command(daemon_cmds.umount)
main.add_command(daemon_cmds.status)
main.add_command(daemon_cmds.cache)
main.add_command(sandbox_cmds.sandbox)
main.add_command(oci_cmds.convert)
main.add_command(oci_cmds.snapshotter)
main.add_command(oci_cmds.image)
trace_cmds.prefetch.add_command(daemon_cmds.prefetch_start)

if __name__ == "__main__":
    main()
