"""``dsecfs sandbox up|exec|down|ls|commit``: sandboxes on this node, through the node daemon.

Each command is a call of the SDK (dsec_fs.client.Node, dsec_fs.sandbox_client.Sandbox). ``up`` starts a
daemon (with its --state-dir and --cache-dir, its log in the state directory) when none answers on the
socket, as ``mount`` does. ``exec`` attaches to the command (Sandbox.attach; terminal.py relays): it writes
the command's stdout and stderr as they come, bytes unchanged, forwards stdin with -i, runs it on a
terminal with -t, and exits with its exit code; dsecfs's own errors exit with their class's code (2 to 7, see cli/main.py), so a
script that needs to tell them apart from the command's should use the SDK.

cli/main.py registers the group by name (LazyCommands: imported when a command line names it).
"""

from __future__ import annotations

import io
import sys

import click

from dsec_fs.api import FILLS
from dsec_fs.client import Node
from dsec_fs.errors import InputError
from dsec_fs.sandbox_client import Sandbox
from dsec_fs.units import parse_size

from .common import emit, json_option, store_option
from .daemon_cmds import RUNTIMES, cache_dir_option, socket_option, state_dir_option
from .terminal import relay, terminal_size


@click.group()
def sandbox() -> None:
    """Sandboxes on this node: layers stacked with OverlayFS, commands run by runc."""


@sandbox.command("up")
@click.option("--base", metavar="LAYER", help="the base image layer (a ref or a digest)")
@click.option("--workspace", metavar="LAYER", help="the workspace layer")
@click.option("--toolkit", "toolkits", multiple=True, metavar="LAYER",
              help="a toolkit layer; may be given again, the first on top")
@click.option("--name", metavar="NAME", help="a name to use instead of the id (default: the id)")
@click.option("--no-profile", is_flag=True,
              help="layers this sandbox mounts first do not prefetch by their access profiles")
@click.option("--fill", type=click.Choice(FILLS), default=None,
              help="what layers this sandbox mounts first fetch in the background (default: the daemon's)")
@store_option
@socket_option
@state_dir_option
@cache_dir_option
@json_option
def up(base: str | None, workspace: str | None, toolkits: tuple[str, ...], name: str | None, no_profile: bool,
       fill: str | None, store_url: str | None, socket_path: str, state_dir: str, cache_dir: str,
       as_json: bool) -> None:
    """Start a sandbox; prints its id and the path of its root filesystem. Any layer may be left out
    (not all); the stack is toolkits, workspace, base, top first. A node daemon is started (with
    --state-dir and --cache-dir) if none answers on the socket. A layer this node has not mounted yet
    prefetches what sandboxes read of it before (its access profile, learned on any node, in the store)."""
    node = Node.ensure_running(socket_path, store=store_url, state_dir=state_dir, cache_dir=cache_dir)
    info = node.sandbox_up(base, workspace, toolkits, name=name, store=store_url, profile=not no_profile,
                           fill=fill)
    emit(as_json, info, lambda: f"{info.id} {info.rootfs}", result=info.id)


class CommandLineCommand(click.Command):
    """A command whose last argument (nargs=-1) is a command line to run: the first word after its other
    arguments starts that command line, so ``exec SANDBOX ls -la`` needs no ``--`` (options before that
    word are still this command's; a command line that starts with a dash needs ``--``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" not in args:
            args = self._separated(args)
        return super().parse_args(ctx, args)

    def _separated(self, args: list[str]) -> list[str]:
        takes_value = {opt for param in self.params if isinstance(param, click.Option) and not param.is_flag
                       and not param.count for opt in param.opts + param.secondary_opts}
        before = sum(1 for param in self.params if isinstance(param, click.Argument) and param.nargs != -1)
        k = 0
        while k < len(args):
            word = args[k]
            if word.startswith("-") and word != "-":
                k += 2 if word in takes_value else 1  # --opt VALUE, or a flag, --opt=VALUE, -eVALUE
                continue
            if before == 0:
                return [*args[:k], "--", *args[k:]]
            before -= 1
            k += 1
        return args


@sandbox.command("exec", cls=CommandLineCommand)
@click.argument("key", metavar="SANDBOX")
@click.argument("command", nargs=-1, required=True)
@click.option("--runtime", type=click.Choice(RUNTIMES), default=None,
              help="runc, or namespaces where runc cannot run (default: the daemon's)")
@click.option("-e", "--env", "env", multiple=True, metavar="NAME=VALUE", help="an environment variable; repeatable")
@click.option("--cwd", default="/", show_default=True, metavar="DIR", help="working directory in the sandbox")
@click.option("--network", is_flag=True, help="share the node's network (default: none)")
@click.option("--memory", default=None, metavar="SIZE", help="memory limit, e.g. 512MiB")
@click.option("--cpus", type=float, default=None, help="CPU limit, in CPUs (e.g. 0.5)")
@click.option("--pids", "pids_limit", type=int, default=None, help="most processes at once")
@click.option("--timeout", type=float, default=None, metavar="SECONDS", help="kill the command after this")
@click.option("-i", "--stdin", "with_stdin", is_flag=True, help="forward this command's stdin to the command")
@click.option("-t", "--tty", "with_tty", is_flag=True,
              help="run the command on a terminal (runc): with -i, this terminal is handed to it (raw mode, ^C "
                   "goes to the command, resizes follow)")
@socket_option
@json_option
def exec_(key: str, command: tuple[str, ...], runtime: str | None, env: tuple[str, ...], cwd: str, network: bool,
          memory: str | None, cpus: float | None, pids_limit: int | None, timeout: float | None, with_stdin: bool,
          with_tty: bool, socket_path: str, as_json: bool) -> None:
    """Run COMMAND in SANDBOX (an id or a name): dsecfs sandbox exec [OPTIONS] SANDBOX CMD ARGS... (put
    -- before CMD if it starts with a dash). Its output is written as it comes; dsecfs exits with its
    exit code."""
    variables = {}
    for item in env:
        name, equals, value = item.partition("=")
        if not equals:
            raise InputError("an environment variable is NAME=VALUE", where=f"--env {item!r}")
        variables[name] = value
    rows, cols = terminal_size() if with_tty else (0, 0)
    attached = Sandbox(Node(socket_path), key).attach(
        list(command), stdin=with_stdin, tty=with_tty, rows=rows, cols=cols, env=variables, cwd=cwd,
        network=network, memory_bytes=None if memory is None else parse_size(memory), cpus=cpus,
        pids_limit=pids_limit, timeout=timeout, runtime=runtime)
    if as_json:  # the output as text (undecodable bytes replaced); the SDK has the bytes
        out, err = io.BytesIO(), io.BytesIO()
        result = relay(attached, forward_stdin=with_stdin, tty_mode=with_tty, out=out, err=err)
        emit(True, {"exit_code": result.exit_code, "timed_out": result.timed_out, "truncated": result.truncated,
                    "stdout": out.getvalue().decode(errors="replace"),
                    "stderr": err.getvalue().decode(errors="replace")}, lambda: "")
        sys.exit(result.exit_code)
    result = relay(attached, forward_stdin=with_stdin, tty_mode=with_tty)
    if result.timed_out:
        click.echo(f"dsecfs: the command ran out of its {timeout:g} s and was killed", err=True)
    if result.truncated:
        click.echo("dsecfs: the command's output was cut: the namespaces runtime gathers each stream and keeps "
                   "its first MiBs (runc streams all of it)", err=True)
    sys.exit(result.exit_code)


@sandbox.command("down")
@click.argument("key", metavar="SANDBOX")
@click.option("--keep", is_flag=True, help="keep the upper dir (the sandbox's changes) for commit")
@socket_option
@json_option
def down(key: str, keep: bool, socket_path: str, as_json: bool) -> None:
    """Take SANDBOX down: unmount it, drop its layers, remove its changes unless --keep."""
    Sandbox(Node(socket_path), key).down(keep=keep)
    emit(as_json, {"sandbox": key, "kept": keep}, lambda: f"{key} down" + (", changes kept" if keep else ""))


@sandbox.command("ls")
@socket_option
@json_option
def ls(socket_path: str, as_json: bool) -> None:
    """List the sandboxes on this node."""
    infos = Node(socket_path).sandboxes()

    def text() -> str:
        lines = [f"{'ID':<16} {'NAME':<20} {'STATUS':<8} {'CREATED':<20} LAYERS"]
        lines += [f"{i.id:<16} {i.name:<20} {i.status:<8} {i.created:<20} "
                  + " ".join(f"{layer.role}={layer.ref}" for layer in i.layers) for i in infos]
        return "\n".join(lines)

    emit(as_json, {"sandboxes": infos}, text)


@sandbox.command("commit")
@click.argument("key", metavar="SANDBOX")
@click.option("--name", "ref", required=True, metavar="NAME:TAG", help="the ref of the new layer")
@click.option("--keep-privileged", is_flag=True,
              help="keep setuid/setgid bits, device nodes and file capabilities (dropped by default)")
@store_option
@socket_option
@json_option
def commit(key: str, ref: str, keep_privileged: bool, store_url: str | None, socket_path: str,
           as_json: bool) -> None:
    """Publish SANDBOX's changes (its upper dir, whiteouts included) as a layer; prints its digest."""
    result = Sandbox(Node(socket_path), key).commit(ref, store=store_url, keep_privileged=keep_privileged)
    dropped = {kind: count for kind, count in result.dropped.items() if count}
    if dropped and not as_json:
        click.echo("dsecfs: left out of the layer (--keep-privileged keeps them): "
                   + ", ".join(f"{count} {kind}" for kind, count in dropped.items()), err=True)
    emit(as_json, result, lambda: result.layer)
