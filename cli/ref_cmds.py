"""``dsecfs ref ls|tag|rm``: the names (NAME:TAG) that point at layers in a store.

A ref is one small object (dsec_fs.layer); removing one frees nothing by itself: the layer and its
chunks go at the next ``dsecfs gc`` once no ref needs them. cli/main.py registers the group by name
(LazyCommands: imported when a command line names it).
"""

from __future__ import annotations

import click

from dsec_fs.layer import delete_ref, list_refs, parse_ref, read_ref, resolve, set_ref
from dsec_fs.store import open_store

from .common import emit, json_option, store_option


@click.group()
def ref() -> None:
    """List, set and remove refs (NAME:TAG -> layer digest)."""


@ref.command("ls")
@click.option("--no-trunc", is_flag=True, help="print whole digests, not their first 12 characters")
@store_option
@json_option
def ls(no_trunc: bool, store_url: str | None, as_json: bool) -> None:
    """List the store's refs and the layers they point at."""
    with open_store(store_url) as store:
        refs = list_refs(store)

    def text() -> str:
        width = max([len(name) for name in refs] + [3])
        lines = [f"{'REF':<{width}}  LAYER"]
        lines += [f"{name:<{width}}  {digest if no_trunc else digest[:12]}" for name, digest in sorted(refs.items())]
        return "\n".join(lines)

    emit(as_json, {"store": store.url, "refs": refs}, text)


@ref.command("tag")
@click.argument("layer")
@click.argument("new_ref", metavar="NAME[:TAG]")
@store_option
@json_option
def tag(layer: str, new_ref: str, store_url: str | None, as_json: bool) -> None:
    """Point NAME[:TAG] at LAYER (a ref, a digest or a digest prefix), replacing what it pointed at."""
    name, tag_ = parse_ref(new_ref)
    with open_store(store_url) as store:
        digest = resolve(store, layer)
        set_ref(store, new_ref, digest)
    emit(as_json, {"store": store.url, "ref": f"{name}:{tag_}", "layer": digest},
         lambda: f"{name}:{tag_} -> {digest}", result=digest)


@ref.command("rm")
@click.argument("refs", nargs=-1, required=True, metavar="NAME[:TAG]...")
@store_option
@json_option
def rm(refs: tuple[str, ...], store_url: str | None, as_json: bool) -> None:
    """Remove refs. The layers stay until `dsecfs gc` finds no ref that needs them."""
    removed = []
    with open_store(store_url) as store:
        for name in refs:
            digest = read_ref(store, name)
            delete_ref(store, name)
            removed.append({"ref": "{}:{}".format(*parse_ref(name)), "layer": digest})
    emit(as_json, {"store": store.url, "removed": removed},
         lambda: "\n".join(f"removed {r['ref']} (was {r['layer'][:12]})" for r in removed))
