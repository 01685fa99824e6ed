"""Options and output helpers shared by every ``dsecfs`` command module.

Every command also gets ``--json``, ``-q/--quiet`` and ``--log-level`` (``add_common_options``, called
once by cli/main.py on the whole command tree). Their values go into the click context's ``meta``, which
all contexts of one invocation share, so that ``emit`` and cli/main.py's error handler see them without
every command function taking them as arguments.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Callable

import click

from dsec_fs.errors import InputError
from dsec_fs.store import DEFAULT_STORE_ENV, default_store_url, init_store
from dsec_fs.store.base import Store
from dsec_fs.units import parse_duration

CHUNK_SIZE_HELP = "chunk size in bytes: a power of two from 4 KiB to 16 MiB"
ENV_PREFIX = "DSECFS"  # click's auto_envvar_prefix: DSECFS_<COMMAND>_<OPTION> for every option
JSON_META = "dsecfs.json"
QUIET_META = "dsecfs.quiet"
LOG_LEVELS = ("debug", "info", "warning", "error")

# The S3 options of every command that opens a store set these (see dsec_fs/store/s3.py), so that a daemon
# the command starts reads the store the same way.
S3_OPTION_ENVS = {"endpoint_url": "DSECFS_S3_ENDPOINT", "profile": "DSECFS_S3_PROFILE", "region": "DSECFS_S3_REGION"}


def _set_s3_env(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:
        os.environ[S3_OPTION_ENVS[param.name]] = value


_store_url_option = click.option(
    "--store", "store_url", default=None, metavar="URL", envvar=DEFAULT_STORE_ENV,
    help=f"chunk store: a path, file:///PATH, posix:///PATH or s3://BUCKET/PREFIX (default {default_store_url()})",
)
_s3_options = [
    click.option("--endpoint-url", default=None, metavar="URL", envvar=S3_OPTION_ENVS["endpoint_url"],
                 expose_value=False, callback=_set_s3_env,
                 help="S3 endpoint, http(s)://HOST[:PORT] (also $AWS_ENDPOINT_URL; default: AWS)"),
    click.option("--profile", default=None, metavar="NAME", envvar=S3_OPTION_ENVS["profile"], expose_value=False,
                 callback=_set_s3_env, help="AWS profile of the S3 credentials (also $AWS_PROFILE)"),
    click.option("--region", default=None, metavar="REGION", envvar=S3_OPTION_ENVS["region"], expose_value=False,
                 callback=_set_s3_env, help="S3 region (also $AWS_REGION)"),
]


def positive(parse: Callable[[str], float], text: str, option: str) -> float:
    """``parse(text)`` (a size, a duration), above zero and finite; InputError naming ``option`` else."""
    try:
        value = parse(text)
    except InputError as exc:
        raise InputError(exc.message, where=f"{option} {text}") from None
    if not 0 < value < float("inf"):
        raise InputError("must be above zero", where=f"{option} {text}")
    return value


def store_option(command):
    """``--store URL`` (passed as ``store_url``) and the S3 options, which set the environment."""
    for option in reversed(_s3_options):
        command = option(command)
    return _store_url_option(command)


def _remember(key: str):
    def callback(ctx: click.Context, param: click.Parameter, value):
        if value:
            ctx.meta[key] = value
        return value

    return callback


json_option = click.option("--json", "as_json", is_flag=True, callback=_remember(JSON_META),
                           help="print one JSON object instead of text (errors too)")
_hidden_json_option = click.option("--json", "as_json", is_flag=True, expose_value=False,
                                   callback=_remember(JSON_META),
                                   help="print one JSON object instead of text (errors too)")
_quiet_option = click.option("-q", "--quiet", is_flag=True, expose_value=False, envvar="DSECFS_QUIET",
                             callback=_remember(QUIET_META),
                             help="print nothing but the result's id (if it has one) and errors")


def _configure_logging(ctx: click.Context, param: click.Parameter, value: str) -> str:
    # The handler's level too: some loggers hold a level of their own (botocore's is INFO or above, see
    # dsec_fs/store/s3.py), and their records reach the root's handlers whatever the root's level is.
    handler = logging.StreamHandler()
    handler.setLevel(value.upper())
    logging.basicConfig(level=value.upper(), format="dsecfs: %(levelname)s %(name)s: %(message)s",
                        handlers=[handler])
    return value


_log_level_option = click.option("--log-level", type=click.Choice(LOG_LEVELS), default="warning",
                                 show_default=True, envvar="DSECFS_LOG_LEVEL", expose_value=False,
                                 callback=_configure_logging, is_eager=True, help="what dsecfs itself logs (stderr)")


class LazyCommands(dict):
    """A group's ``commands`` (name -> command) where some commands are imported when first looked up:
    ``lazy`` maps a name to (module of this package, attribute) or to a function that returns the command.
    A command loaded gets the common options (``add_common_options``). Looking a name up loads that one;
    iterating, ``len`` aside, loads them all (so --help, the configuration file and ``walk_commands`` see
    every command). Threads: the CLI's one thread."""

    def __init__(self, loaded: dict[str, click.Command], lazy: dict):
        super().__init__(loaded)
        self._lazy = dict(lazy)

    def _load(self, name: str) -> None:
        where = self._lazy.pop(name, None)
        if where is None:
            return
        if callable(where):
            command = where()
        else:
            module, attribute = where
            command = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
        add_common_options(command)
        dict.__setitem__(self, name, command)

    def _load_all(self) -> None:
        for name in list(self._lazy):
            self._load(name)

    def __getitem__(self, name: str) -> click.Command:
        self._load(name)
        return dict.__getitem__(self, name)

    def get(self, name: str, default=None):
        self._load(name)
        return dict.get(self, name, default)

    def __contains__(self, name) -> bool:
        return name in self._lazy or dict.__contains__(self, name)

    def __len__(self) -> int:
        return dict.__len__(self) + len(self._lazy)

    def __iter__(self):
        self._load_all()
        return dict.__iter__(self)

    def keys(self):
        self._load_all()
        return dict.keys(self)

    def values(self):
        self._load_all()
        return dict.values(self)

    def items(self):
        self._load_all()
        return dict.items(self)


def walk_commands(command: click.Command, path: tuple[str, ...] = ()):
    """(path of names, command) for ``command`` and every command below it."""
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from walk_commands(sub, (*path, name))


def add_common_options(root: click.Group) -> None:
    """Give every command --json, -q and --log-level (unless it has its own), and show every option's
    environment variable in --help."""
    for _path, command in walk_commands(root):
        if not isinstance(command, click.Group):
            names = {param.name for param in command.params}
            extra = [option for name, option in (("as_json", _hidden_json_option), ("quiet", _quiet_option),
                                                 ("log_level", _log_level_option)) if name not in names]
            for option in extra:
                option(command)
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "version":
                param.show_envvar = True


def quiet() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get(QUIET_META))


def wants_json() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get(JSON_META))


def _api_builtins(value):
    """json.dumps's ``default``: a type of dsec_fs/api.py (or bytes, a set) as the API encodes it. Imported
    only when a value needs it: the API types cost a command ~40 ms to import (a build's JSON is dicts)."""
    from dsec_fs import api

    return api.to_builtins(value)


def emit(as_json: bool, data: object, text: Callable[[], str], *, result: str | None = None) -> None:
    """Print ``data`` (a dict, or a type of dsec_fs/api.py) as JSON, or ``text()``; under -q only ``result``
    (the id a script wants), if any."""
    if as_json or wants_json():
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=_api_builtins))
    elif quiet():
        if result is not None:
            click.echo(result)
    else:
        click.echo(text())


def note(message: str) -> None:
    """A side remark on stderr (what a command did besides its result), silenced by -q and --json."""
    if not (quiet() or wants_json()):
        click.echo(f"dsecfs: {message}", err=True)


def store_to_publish_in(store_url: str | None) -> Store:
    """The store a command publishes layers in (build, convert): made on first use, saying so."""
    store, created = init_store(store_url)
    if created:
        note(f"created store {store.url}")
    return store


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
