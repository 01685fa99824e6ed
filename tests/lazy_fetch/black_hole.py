"""An S3 endpoint that stops answering, made for real: a TCP proxy on 127.0.0.1 in front of a moto server
that relays both ways until ``hang()``; from then on it accepts connections and reads requests, new or
on connections already open, and never sends a byte back (what an endpoint behind a stuck load balancer
does: the client waits out its read timeout, and its retries meet the same).

    with BlackHoleProxy(moto_url) as proxy:   # proxy.url in place of the endpoint
        ...
        proxy.hang()

Import it as ``tests.lazy_fetch.black_hole``. One thread accepts; each connection has a thread per
direction; ``_hung`` (an Event) is read by all of them; ``_sockets`` is guarded by ``_lock``.
"""

from __future__ import annotations

import socket
import threading
import urllib.parse


class BlackHoleProxy:
    def __init__(self, upstream_url: str):
        parsed = urllib.parse.urlsplit(upstream_url)
        self._upstream = (parsed.hostname, parsed.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._hung = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="black-hole-accept").start()

    def hang(self) -> None:
        self._hung.set()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()

    def __enter__(self) -> BlackHoleProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _keep(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
        return sock

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._keep(client)
            upstream = None if self._hung.is_set() else self._keep(socket.create_connection(self._upstream))
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self._relay, args=(upstream, client), daemon=True).start()

    def _relay(self, source: socket.socket, target: socket.socket | None) -> None:
        """Bytes from ``source`` to ``target`` until either closes; once hung (or with no target),
        read and dropped."""
        try:
            while data := source.recv(65536):
                if target is not None and not self._hung.is_set():
                    target.sendall(data)
        except OSError:
            pass
