"""Store maintenance commands: ``dsecfs gc``, ``dsecfs store init`` and ``dsecfs store stats``."""

from __future__ import annotations

import click

from dsec_fs.store import init_store, open_store
from dsec_fs.units import human_size

from .common import Duration, emit, json_option, store_option

@click.command("gc")
@store_option
@click.option("--grace", "grace_seconds", type=Duration(), default="24h", show_default=True,
              help="leave alone anything younger than this (layers without a ref, packs, trashed packs)")
@click.option("--dry-run", is_flag=True, help="report what would be done, change nothing")
@click.option("--keep-unreferenced-layers", is_flag=True,
              help="keep published layers no ref names, however old (by default they go after --grace)")
@click.option("--repack-threshold", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="repack packs whose live bytes are below this fraction (0: never)")
@json_option
def gc_command(store_url: str | None, grace_seconds: float, dry_run: bool, keep_unreferenced_layers: bool,
               repack_threshold: float, as_json: bool) -> None:
    """Delete layers no ref needs and the packs only they used; repack sparse packs.

    Safe while builds run: packs are first soft-deleted (their index removed) and only a later run,
    after the grace period and once no build that started before may still use them, deletes them.
    """
    from dsec_fs.gc import gc
    from lazy_fetch.meta_cache import MANIFEST_FRESH_SECONDS

    if grace_seconds < MANIFEST_FRESH_SECONDS and not dry_run:
        # A repack's old packs go after the grace, and a node trusts its copy of a layer's manifest (the
        # old pack list) for MANIFEST_FRESH_SECONDS: a shorter grace can delete packs a node still reads.
        click.echo(f"warning: a grace under {MANIFEST_FRESH_SECONDS / 3600:g} h can delete repacked packs that "
                   "nodes still read through their copies of layer manifests (lazy_fetch/meta_cache.py)", err=True)
    with open_store(store_url) as store:
        report = gc(store, grace_seconds=grace_seconds, dry_run=dry_run, repack_threshold=repack_threshold,
                    keep_unreferenced_layers=keep_unreferenced_layers)
    emit(as_json, {"store": store.url, **report.to_dict()}, report.summary)


@click.group("store")
def store_group() -> None:
    """Create or inspect a chunk store."""


@store_group.command("init")
@click.argument("url", required=False, metavar="[URL]")
@store_option
@json_option
def init_command(url: str | None, store_url: str | None, as_json: bool) -> None:
    """Create the store at URL (default: --store): its directory, or its S3 bucket. An existing store is
    left as it is. No other command creates a store, but `build`, which makes one on first use."""
    store, created = init_store(url or store_url)
    with store:
        emit(as_json, {"store": store.url, "created": created},
             lambda: f"{'created' if created else 'already there:'} store {store.url}", result=store.url)


@store_group.command("stats")
@store_option
@json_option
def stats_command(store_url: str | None, as_json: bool) -> None:
    """Layers, refs, chunks and packs in the store; logical versus stored bytes, and the dedup ratio."""
    from dsec_fs.store_stats import store_stats

    with open_store(store_url) as store:
        stats = store_stats(store)

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def text() -> str:
        return "\n".join([
            f"store          {stats['store']}",
            f"layers         {stats['layers']:>12,}   refs {stats['refs']:,}",
            f"chunks         {stats['chunks']:>12,}",
            f"packs          {stats['packs']:>12,}   ({stats['trashed_packs']:,} trashed)",
            f"logical bytes  {human_size(stats['logical_bytes']):>12}",
            f"unique bytes   {human_size(stats['unique_bytes']):>12}   dedup {ratio(stats['dedup_ratio'])}",
            f"stored bytes   {human_size(stats['stored_bytes']):>12}   overall {ratio(stats['storage_ratio'])}",
        ])

    emit(as_json, stats, text)
