"""``dsecfs convert`` and the registry options that ``build`` shares: images to and from OCI registries."""

from __future__ import annotations

import click

from dsec_fs.units import human_size, parse_duration, parse_size

from .common import CHUNK_SIZE_HELP, emit, json_option, positive, store_option, store_to_publish_in

REGISTRY_TIMEOUT_META, REGISTRY_MIN_RATE_META = "dsecfs.registry_timeout", "dsecfs.registry_min_rate"


def _remember_positive(key: str, parse):
    """A callback that keeps the option's value, parsed by ``parse`` and above zero, in ``ctx.meta[key]``."""
    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        if value is not None:
            ctx.meta[key] = positive(parse, value, param.opts[0])

    return callback


_registry_options = [
    click.option("--plain-http", is_flag=True,
                 help="talk to docker:// registries over plain HTTP (a local registry without TLS)"),
    click.option("--registry-timeout", metavar="DURATION", expose_value=False,
                 callback=_remember_positive(REGISTRY_TIMEOUT_META, parse_duration),
                 help="a registry request and its answer, and the floor of a blob transfer's deadline "
                      "(default 60s)"),
    click.option("--registry-min-rate", metavar="SIZE", expose_value=False,
                 callback=_remember_positive(REGISTRY_MIN_RATE_META, parse_size),
                 help="bytes a second a blob transfer must keep up on average, over and above the timeout "
                      "(default 1MiB)"),
]


def registry_option(command):
    """``--plain-http`` (passed as ``plain_http``), ``--registry-timeout`` and ``--registry-min-rate``
    (which registry_options reads)."""
    for option in reversed(_registry_options):
        command = option(command)
    return command


def registry_options(plain_http: bool):
    """How to reach registries, from the command's options (credentials: the auth files, see docs/guide.md);
    None if every option is left at its default (then the registry client is not even imported)."""
    meta = click.get_current_context().meta
    bounds = {name: meta[key] for name, key in (("timeout", REGISTRY_TIMEOUT_META),
                                                ("min_rate", REGISTRY_MIN_RATE_META)) if key in meta}
    if not plain_http and not bounds:
        return None
    from erofs_builder.registry import RegistryOptions

    return RegistryOptions(plain_http=plain_http, **bounds)


@click.command()
@click.argument("source")
@click.argument("target")
@store_option
@click.option("--name", "ref", metavar="NAME:TAG", help="also publish the layers as refs NAME:TAG-l0, -l1, ...")
@click.option("--platform", default="linux/amd64", show_default=True, help="which image of an OCI index")
@click.option("--chunk-size", default="1MiB", show_default=True, help=CHUNK_SIZE_HELP)
@registry_option
@json_option
def convert(source: str, target: str, store_url: str | None, ref: str | None, platform: str, chunk_size: str,
            plain_http: bool, as_json: bool) -> None:
    """Convert image SOURCE into dsecfs layers and push it to TARGET (docker://HOST[:PORT]/REPO:TAG).

    SOURCE is any image `dsecfs build` takes (docker://..., oci:DIR:TAG, a layout or an image archive).
    The pushed image keeps SOURCE's config; each layer's blob is the dsecfs layer's meta.erofs, its
    annotations name the layer and the store (containerd.io/snapshot/dsecfs.*)."""
    from erofs_builder.convert import convert_image

    with store_to_publish_in(store_url) as store:
        result = convert_image(source, target, store, platform=platform, chunk_size=parse_size(chunk_size),
                               registry=registry_options(plain_http), name=ref)
    data = {"target": result.target, "manifest": result.manifest_digest, "store": store.url,
            "pushed_blobs": result.pushed_blobs,
            "layers": [{"layer": r.digest, "stats": r.manifest.stats} for r in result.layers]}

    def text() -> str:
        lines = [f"layer {k}  {r.digest}  {r.manifest.stats['files']:,} files" for k, r in enumerate(result.layers)]
        build = result.layers[0].manifest.stats if result.layers else {"new_bytes": 0, "new_chunks": 0}
        return "\n".join(lines + [
            f"new         {human_size(build['new_bytes'])} in {build['new_chunks']:,} chunks",
            f"pushed      {result.pushed_blobs} blobs",
            f"image       {result.target}",
        ])

    emit(as_json, data, text)


@click.command()
@click.option("--root", default="/var/lib/dsecfs/snapshotter", show_default=True, type=click.Path(path_type=str),
              help="where snapshots and their metadata live")
@click.option("--socket", "socket_path", default="/run/dsecfs/snapshotter.sock", show_default=True,
              type=click.Path(path_type=str), help="the unix socket containerd's proxy_plugins entry names")
@click.option("--daemon-socket", default=None, type=click.Path(path_type=str),
              help="the node daemon that mounts dsecfs layers (default $DSECFS_SOCKET or /run/dsecfs/daemon.sock)")
@click.option("--allow-store", "allowed_stores", multiple=True, metavar="URL",
              help="a store converted images may name (containerd.io/snapshot/dsecfs.store); repeatable")
@click.option("--prefetch-dir", default=None, type=click.Path(file_okay=False, path_type=str),
              help="prefetch lists to mount layers with: DIR/<layer digest>.json (dsecfs prefetch build)")
def snapshotter(root: str, socket_path: str, daemon_socket: str | None, allowed_stores: tuple[str, ...],
                prefetch_dir: str | None) -> None:
    """Serve containerd's Snapshots API (a proxy snapshotter plugin): converted images' layers are mounted
    through the node daemon, other images are unpacked by containerd as usual."""
    import logging

    from dsec_fs.client import Node
    from dsec_fs.store import open_store
    from overlay.snapshotter import Snapshots
    from overlay.snapshotter_grpc import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Stores as the store option spells them (a path becomes file://...), the form convert records.
    stores = tuple(open_store(url).url for url in allowed_stores)
    snapshots = Snapshots(root, Node(daemon_socket), stores, prefetch_dir)
    try:
        remounted = snapshots.remount_layers()
        if remounted:
            logging.getLogger(__name__).info("mounted %d remote layers again", remounted)
        serve(snapshots, socket_path)
    finally:
        snapshots.close()


@click.group()
def image() -> None:
    """Images in containerd, unpacked by the dsecfs snapshotter."""


@image.command("pull")
@click.argument("ref")
@click.option("--address", default="/run/containerd/containerd.sock", show_default=True,
              type=click.Path(path_type=str), help="containerd's gRPC socket")
@click.option("--namespace", default="default", show_default=True, help="containerd namespace (k8s.io for kubelet)")
@click.option("--snapshotter", "snapshotter_name", default="dsecfs", show_default=True,
              help="the proxy_plugins name of dsecfs snapshotter in containerd's config")
@click.option("--platform", default="linux/amd64", show_default=True, help="which image of an OCI index")
@registry_option
@json_option
def image_pull(ref: str, address: str, namespace: str, snapshotter_name: str, platform: str, plain_http: bool,
               as_json: bool) -> None:
    """Pull image REF (docker://HOST/REPO:TAG) into containerd, unpacked by the dsecfs snapshotter: the layers
    of a converted image (`dsecfs convert`) are mounted lazily, without downloading them; other layers are
    downloaded and unpacked as containerd would."""
    from overlay.containerd_client import ContainerdClient
    from overlay.image_pull import pull_image

    with ContainerdClient(address, namespace) as containerd:
        result = pull_image(ref, containerd, snapshotter=snapshotter_name, platform=platform,
                            registry=registry_options(plain_http))
    data = {"image": result.name, "manifest": result.manifest_digest, "snapshots": result.chain_ids,
            "mounted": result.mounted, "unpacked": result.unpacked}
    emit(as_json, data, lambda: f"{result.name}  {result.manifest_digest}\n{len(result.chain_ids)} layers: "
                                f"{result.mounted} dsecfs layers mounted, {result.unpacked} unpacked now")
