"""Options and output helpers shared by every ``dsecfs`` command module."""

from __future__ import annotations

import json
from collections.abc import Callable

import click

from dsec_fs import api
from dsec_fs.errors import InputError
from dsec_fs.store import default_store_url
from dsec_fs.units import parse_duration

CHUNK_SIZE_HELP = "chunk size in bytes: a power of two from 4 KiB to 16 MiB"


store_option = click.option(
    "--store", "store_url", default=None, metavar="URL",
    help="chunk store: a path, file://, posix:// or s3://BUCKET/PREFIX (default $DSECFS_STORE or "
         f"{default_store_url()})",
)
json_option = click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text")


class Duration(click.ParamType):
    """A duration option (dsec_fs.units.parse_duration), as seconds."""

    name = "duration"

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(value)
        except InputError as exc:
            self.fail(str(exc), param, ctx)


def emit(as_json: bool, data: object, text: Callable[[], str]) -> None:
    """``data`` (a dict, or a type of dsec_fs/api.py) as JSON, or ``text()``."""
    click.echo(json.dumps(api.to_builtins(data), indent=2, sort_keys=True) if as_json else text())
