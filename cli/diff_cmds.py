"""``dsecfs diff``: what changed between two layers."""

from __future__ import annotations

import click

from dsec_fs.store import open_store

from .common import emit, json_option, store_option


@click.command()
@click.argument("a")
@click.argument("b")
@store_option
@json_option
def diff(a: str, b: str, store_url: str | None, as_json: bool) -> None:
    """Show what layer B adds, removes and changes relative to layer A (refs or digests), and the chunks
    they share. Reads metadata only: contents are compared by chunk digests."""
    from erofs_builder.diff import diff_layers

    with open_store(store_url) as store:
        result = diff_layers(store, a, b)
    emit(as_json, result.to_dict(), result.text)
