"""The local end of ``dsecfs sandbox exec``: an attached command's output written as it comes, stdin
forwarded, and with ``-t`` the local terminal handed to the command.

With a terminal (``-t`` and ``-i`` on a stdin that is one) the local terminal is put in raw mode, so every
key, ^C included, goes to the command (its terminal's line discipline makes ^C a SIGINT there, not here),
and restored on every way out (the command's end, an error, SIGTERM or SIGHUP: exit 128 + N); its size is sent at start by the
caller and again at each SIGWINCH. Without a terminal, ^C stops dsecfs, which closes the connection: the
daemon kills the command.

Threads: ``relay`` runs in the main thread (the SIGWINCH handler runs there too); stdin is read and sent by
a daemon thread of its own, so a command that does not read its stdin never keeps its output from being
written here.
"""

from __future__ import annotations

import os
import signal
import sys
import termios
import threading
import tty
from typing import BinaryIO

from dsec_fs import exec_frames
from dsec_fs.api import ExecExit
from dsec_fs.attach_client import AttachedCommand
from dsec_fs.errors import UnavailableError

LEAVING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # would end dsecfs with the terminal left raw


def terminal_size() -> tuple[int, int]:
    """(rows, columns) of the terminal on stdin or stdout; (0, 0) when neither is one."""
    for stream in (sys.stdin, sys.stdout):
        try:
            size = os.get_terminal_size(stream.fileno())
        except (OSError, ValueError):
            continue
        return size.lines, size.columns
    return 0, 0


def relay(command: AttachedCommand, *, forward_stdin: bool, tty_mode: bool,
          out: BinaryIO | None = None, err: BinaryIO | None = None) -> ExecExit:
    """Relay until the command exits; its ExecExit. ``out``/``err``: where its output goes (default:
    our stdout and stderr, flushed at each write)."""
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    stdin_fd = sys.stdin.fileno() if forward_stdin else -1  # (without -i, stdin may even be closed)
    saved = termios.tcgetattr(stdin_fd) if tty_mode and forward_stdin and os.isatty(stdin_fd) else None
    previous = {}  # signal -> the handler it had
    try:
        if saved is not None:
            for number in LEAVING_SIGNALS:  # so that the finally below runs: the terminal is restored
                previous[number] = signal.signal(number, _leave)
            tty.setraw(stdin_fd)
        if tty_mode:
            previous[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, lambda *_: _send_size(command))
        if forward_stdin:
            threading.Thread(target=_forward_stdin, args=(command, stdin_fd), daemon=True,
                             name="stdin").start()
        for stream, data in command.output():
            target = out if stream == "stdout" else err
            target.write(data)
            target.flush()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if saved is not None:
            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
        command.close()
    return command.result


def _leave(number: int, _frame) -> None:
    raise SystemExit(128 + number)  # as the signal's default action would have ended us, after the finally


def _send_size(command: AttachedCommand) -> None:
    rows, cols = terminal_size()
    if rows and cols:
        try:
            command.resize(rows, cols)
        except UnavailableError:
            pass  # the command is ending; its output loop reports how


def _forward_stdin(command: AttachedCommand, fd: int) -> None:
    try:
        while True:
            data = os.read(fd, exec_frames.CHUNK)
            if not data:
                command.close_stdin()
                return
            command.write(data)
    except (OSError, UnavailableError):
        return  # stdin unreadable, or the command ended and the connection closed
