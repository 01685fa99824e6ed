"""The scheduler service's connection bounds (overlay/http_bounds.py), over real sockets on 127.0.0.1,
the hostile connections made by another local user (uid 65534, setpriv): any user of the host can reach
the port.

Before: a thread per connection, with no bound and no deadline: 500 idle or dripping connections were
500 threads held for as long as their user liked, and a request sent a byte at a time was waited for
without end.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from overlay.sched_service import SchedService
from tests.other_user import NOBODY
from tests.overlay.test_sched_service import call

pytestmark = pytest.mark.root  # setpriv to another user

# Opens IDLE connections that send nothing and DRIP that send a request a byte every 0.2 s; says
# "holding" once all are open; when its stdin closes, prints how many the server closed meanwhile.
_HOSTILE = r"""
import json, select, socket, sys, time
port, idle, drip = (int(a) for a in sys.argv[1:4])
request = b"POST /v1/place HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"{" * 100000
held = []
for n in range(idle + drip):
    sock = socket.create_connection(("127.0.0.1", port))
    held.append([sock, n >= idle, 0])  # socket, drips, bytes sent
print("holding", flush=True)
closed = set()
while True:
    ready, _, _ = select.select([sys.stdin] + [h[0] for h in held if h[0].fileno() not in closed], [], [], 0.2)
    if sys.stdin in ready:
        break
    for entry in held:
        sock = entry[0]
        if sock.fileno() in closed:
            continue
        try:
            if sock in ready and not sock.recv(65536):
                closed.add(sock.fileno())
            elif entry[1]:
                entry[2] += sock.send(request[entry[2]:entry[2] + 1])
        except OSError:
            closed.add(sock.fileno())
print(json.dumps({"held": len(held), "closed": len(closed)}), flush=True)
"""


class Hostile:
    def __init__(self, svc: SchedService, idle: int, drip: int):
        port = svc.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                      "/usr/bin/python3", "-I", "-S", "-c", _HOSTILE, port, str(idle), str(drip)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "holding\n"

    def end(self) -> dict:
        """How many connections it held, and how many of them the server closed."""
        out, _ = self.proc.communicate(timeout=30)
        return json.loads(out)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _honest_calls(svc: SchedService) -> None:
    assert call(svc, "POST", "/v1/nodes/register", {"name": "node-1", "capacity": 4})[0] == 200
    assert call(svc, "POST", "/v1/nodes/node-1/report", {"running": 1, "cached": {"a1" * 32: 100}})[0] == 200
    assert call(svc, "POST", "/v1/place", {"layers": ["a1" * 32]}) == (200, {"node": "node-1"})


def test_an_honest_client_is_served_while_another_user_holds_hundreds_of_connections():
    """400 idle connections and 100 dripping a request, with the default bounds: the service keeps at most
    256 of them (threads too), the oldest closed for newcomers, and the honest client gets its answers."""
    threads_before = threading.active_count()
    svc = SchedService(port=0).start()
    hostile = None
    try:
        hostile = Hostile(svc, idle=400, drip=100)
        time.sleep(1.5)  # each of them has waited for an answer longer than a new one must
        _honest_calls(svc)
        assert threading.active_count() - threads_before <= 256 + 2  # the serving thread, the reaper
        held = hostile.end()
        assert held["held"] == 500 and held["closed"] >= 500 - 256
    finally:
        if hostile is not None:
            hostile.kill()
        svc.stop()


def test_idle_and_dripping_connections_are_closed_at_their_deadlines():
    from overlay.http_bounds import ConnectionBounds

    svc = SchedService(port=0, bounds=ConnectionBounds(idle_seconds=1.0, request_seconds=1.5)).start()
    hostile = None
    try:
        hostile = Hostile(svc, idle=20, drip=20)
        deadline = time.monotonic() + 20
        while svc.connections and time.monotonic() < deadline:
            time.sleep(0.1)
        assert svc.connections == 0
        assert hostile.end() == {"held": 40, "closed": 40}
        _honest_calls(svc)
    finally:
        if hostile is not None:
            hostile.kill()
        svc.stop()


def test_a_connection_beyond_the_bound_is_refused_cleanly_when_none_may_be_closed_for_it():
    from overlay.http_bounds import ConnectionBounds

    svc = SchedService(port=0, bounds=ConnectionBounds(max_connections=8, evictable_after=600.0)).start()
    hostile = None
    try:
        hostile = Hostile(svc, idle=8, drip=0)
        deadline = time.monotonic() + 10
        while svc.connections < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body = call(svc, "GET", "/v1/nodes")
        assert status == 503 and body["error"] == "unavailable" and "8 connections" in body["message"]
        assert svc.connections == 8
        assert hostile.end() == {"held": 8, "closed": 0}
        deadline = time.monotonic() + 10
        while svc.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        _honest_calls(svc)
    finally:
        if hostile is not None:
            hostile.kill()
        svc.stop()
