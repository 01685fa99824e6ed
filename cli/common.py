"""Options and output helpers shared by every ``dsecfs`` command module."""

from __future__ import annotations

import json
from collections.abc import Callable

import click

from dsec_fs.errors import InputError
from dsec_fs.store import default_store_url

CHUNK_SIZE_HELP = "chunk size in bytes: a power of two from 4 KiB to 16 MiB"


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def parse_size(text: str) -> int:
    """Bytes from '4096', '64K', '1MiB', '2g' (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    spelled = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(spelled[-1:], 1)
    try:
        return int(spelled[:-1] if scale > 1 else spelled) * scale
    except ValueError:
        raise InputError(f"not a size: {text!r} (use e.g. 4096, 64K, 1MiB, 2G)") from None


store_option = click.option(
    "--store", "store_url", default=None, metavar="URL",
    help="chunk store: a path, file://, posix:// or s3://BUCKET/PREFIX (default $DSECFS_STORE or "
         f"{default_store_url()})",
)
json_option = click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text")


def emit(as_json: bool, data: dict, text: Callable[[], str]) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True) if as_json else text())
