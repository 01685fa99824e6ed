"""The configuration file: defaults for any option of any command, in TOML.

    /etc/dsecfs/config.toml (or $DSECFS_CONFIG, or ``dsecfs --config FILE``):

    store = "s3://layers/prod"        # a key at the top applies to every command with that option
    log-level = "info"
    [daemon]
    cache-dir = "/srv/dsecfs/chunks"  # keys are the long option names (--cache-dir), - or _ alike
    cache-size = "200GB"
    [sandbox.up]                      # a group's table holds its commands' tables (and its own keys)
    toolkit = ["tk/agent:3"]

What wins: the command line, then the environment (DSECFS_STORE and the like, or click's
DSECFS_<COMMAND>_<OPTION>), then this file, then the built-in default. A key no command below its table
has, or a table that names no command, is an InputError naming the file and the key: a typo must not
be ignored silently. The file becomes click's ``default_map``.
"""

from __future__ import annotations

import os

import click

from dsec_fs.errors import InputError

CONFIG_ENV = "DSECFS_CONFIG"
DEFAULT_CONFIG = "/etc/dsecfs/config.toml"


def config_path(explicit: str | None) -> str | None:
    """The file to read: ``explicit`` (--config or $DSECFS_CONFIG, which must exist), else the system
    file if there is one."""
    if explicit:
        return explicit
    return DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG) else None


def load_default_map(root: click.Group, path: str) -> dict:
    import tomllib  # only with a configuration file: every command would pay for the import otherwise

    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise InputError(f"cannot read the configuration file: {exc.strerror}", where=path) from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"not TOML: {exc}", where=path) from None
    return _defaults(root, table, {}, path, "")


def _key(name: str) -> str:
    return name.replace("-", "_")


def _option_keys(command: click.Command) -> dict[str, str]:
    """Config key -> parameter name, for every option of ``command`` (long name and parameter name)."""
    keys = {}
    for param in command.params:
        if isinstance(param, click.Option) and param.name:
            keys[param.name] = param.name
            for opt in param.opts:
                if opt.startswith("--"):
                    keys[_key(opt[2:])] = param.name
    return keys


def _all_keys(command: click.Command) -> set[str]:
    keys = set(_option_keys(command))
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            keys |= _all_keys(sub)
    return keys


def _defaults(command: click.Command, table: dict, inherited: dict, path: str, where: str) -> dict:
    scalars = {_key(k): v for k, v in table.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    known = _all_keys(command)
    for key in scalars:
        if key not in known:
            raise InputError(f"no option --{key.replace('_', '-')} in {where or 'any command'}",
                             where=f"{path}: {where + '.' if where else ''}{key}")
    merged = {**inherited, **scalars}
    if not isinstance(command, click.Group):
        if tables:
            raise InputError(f"{where} is a command, not a group", where=f"{path}: [{where}.{next(iter(tables))}]")
        options = _option_keys(command)
        return {options[key]: value for key, value in merged.items() if key in options}
    result = {}
    for name in tables:
        if name not in command.commands:
            raise InputError("no such command", where=f"{path}: [{where + '.' if where else ''}{name}]")
    for name, sub in command.commands.items():
        result[name] = _defaults(sub, tables.get(name, {}), merged, path, f"{where}.{name}" if where else name)
    return result
