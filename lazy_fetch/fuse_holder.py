"""The FUSE fd holder: a small process that keeps a copy of the daemon's /dev/fuse fd, so the kernel's
FUSE connection (and every layer mounted through it) outlives a daemon that dies, and hands the fd to the
next daemon (``--fuse-binding raw``; see fuse_raw.py and layer_mount.py).

    python -m lazy_fetch.fuse_holder --fd N SOCKET

The daemon starts it (``spawn``) right after mounting its FUSE session, passing the fd. The holder listens
on the unix socket SOCKET (SOCK_SEQPACKET, in the state directory, which only root can enter; it also
checks the peer's uid) and answers one request per connection:

- ``take``: the fd, as SCM_RIGHTS (``take``): a daemon starting on the state directory resumes serving it;
- ``stop``: close the fd and exit (``stop``): a daemon shutting down normally, which unmounts its layers,
  ends the connection this way (the kernel aborts it once no process holds the fd);
- ``ping``: answer ``pong``.

Why a process of its own: while any process holds a /dev/fuse fd of a connection, the kernel keeps the
connection, queueing requests until someone reads them; when the last one closes it, the connection is
aborted and every mount on it fails with ENOTCONN. The holder runs in a session of its own, so a signal
to the daemon's process group does not reach it, and imports nothing but the standard library, so it
starts fast and has nothing to crash on. It never reads the fd. Anyone who wants the mounts gone without
a daemon: ``stop`` (or SIGTERM the holder) and unmount.

Threads: the holder is single-threaded. The client functions block (the daemon calls them through
trio.to_thread) and may be called from any thread.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys

READY = b"ready\n"  # the holder's first line on stdout, once it listens
TIMEOUT = 10.0  # seconds a client waits for the holder to answer
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _serve(fd: int, path: str) -> None:
    try:
        os.unlink(path)  # a socket left by a holder that was killed
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(4)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the spawner stops reading
    while True:
        conn, _address = listener.accept()
        with conn:
            _pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                _PEERCRED.size))
            if uid not in (0, os.geteuid()):
                continue
            request = conn.recv(16)
            if request == b"take":
                socket.send_fds(conn, [b"fd"], [fd])
            elif request == b"ping":
                conn.send(b"pong")
            elif request == b"stop":
                os.close(fd)
                os.unlink(path)
                conn.send(b"stopped")
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lazy_fetch.fuse_holder", description=__doc__.split("\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="the /dev/fuse fd to hold (inherited)")
    parser.add_argument("socket", help="unix socket to listen on")
    args = parser.parse_args(argv)
    os.set_inheritable(args.fd, False)
    _serve(args.fd, args.socket)
    return 0


# ---- the daemon's side ------------------------------------------------------------------------------


def spawn(path: str, fd: int) -> subprocess.Popen:
    """Start a holder of ``fd`` listening on ``path``; returns once it listens. It runs in a session of its
    own and outlives the caller; the caller should ``wait`` for it after ``stop`` if it is still alive."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen([sys.executable, "-m", "lazy_fetch.fuse_holder", "--fd", str(fd), path],
                               pass_fds=[fd], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL,  # it must not hold the daemon's log or pipes open
                               cwd="/", env=env, start_new_session=True)
    with process.stdout:
        line = process.stdout.readline()
    if line != READY:
        process.kill()
        process.wait()
        raise OSError(f"the FUSE fd holder did not start (exit status {process.returncode})")
    return process


def _ask(path: str, request: bytes) -> socket.socket | None:
    """A connection to the holder at ``path`` with ``request`` sent, or None when no holder listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(TIMEOUT)
    try:
        sock.connect(path)
        sock.send(request)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


def take(path: str) -> int | None:
    """A new fd for the connection the holder at ``path`` holds (close-on-exec), or None if none listens."""
    sock = _ask(path, b"take")
    if sock is None:
        return None
    with sock:
        _message, fds, _flags, _address = socket.recv_fds(sock, 16, 1)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(f"the FUSE fd holder at {path} sent {len(fds)} fds")
    os.set_inheritable(fds[0], False)
    return fds[0]


def stop(path: str) -> bool:
    """Make the holder at ``path`` close its fd and exit; False if none listens. Returns once it closed it."""
    sock = _ask(path, b"stop")
    if sock is None:
        return False
    with sock:
        answer = sock.recv(16)
    if answer != b"stopped":
        raise OSError(f"the FUSE fd holder at {path} answered {answer!r} to stop")
    return True


def alive(path: str) -> bool:
    sock = _ask(path, b"ping")
    if sock is None:
        return False
    with sock:
        return sock.recv(16) == b"pong"


if __name__ == "__main__":
    sys.exit(main())
