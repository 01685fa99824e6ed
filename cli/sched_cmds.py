"""``dsecfs sched``: the sandbox scheduler's simulator and service (overlay.sched_sim, overlay.sched_service).

Registered on the main group by name in cli/main.py (LazyCommands: imported when a command line names
it).
"""

from __future__ import annotations

import functools
import json

import click

from dsec_fs.errors import InputError
from dsec_fs.units import parse_duration

from .common import positive


@click.group()
def sched() -> None:
    """Sandbox placement: simulate policies, or serve the scheduler (and Kubernetes extender) over HTTP."""


@sched.command()
@click.option("--nodes", default=1000, show_default=True, help="nodes in the cluster (10 to 10,000)")
@click.option("--slots", default=16, show_default=True, help="sandbox slots per node")
@click.option("--requests", default=100_000, show_default=True, help="sandbox starts to replay")
@click.option("--combinations", default=5000, show_default=True, help="distinct base/workspace/toolkit triples")
@click.option("--zipf", default=1.1, show_default=True, help="Zipf exponent of the combinations' popularity")
@click.option("--seed", default=0, show_default=True, help="seed of the workload (and of random placement)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the table")
def simulate(nodes: int, slots: int, requests: int, combinations: int, zipf: float, seed: int,
             as_json: bool) -> None:
    """Replay a bursty workload under affinity, least-loaded and random placement, and compare them."""
    from overlay.sched_sim import SimConfig, compare, format_table

    cfg = SimConfig(nodes=nodes, slots=slots, requests=requests, combinations=combinations, zipf=zipf, seed=seed)
    results = compare(cfg)
    if as_json:
        data = {"config": {"nodes": nodes, "slots": slots, "requests": requests, "combinations": combinations,
                           "zipf": zipf, "seed": seed},
                "results": [r.to_dict() for r in results]}
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        click.echo(f"{nodes:,} nodes x {slots} slots, {requests:,} requests over {combinations:,} combinations "
                   f"(Zipf {zipf}), seed {seed}")
        click.echo(format_table(results))


@sched.command()
@click.option("--listen", default="127.0.0.1:8470", show_default=True, metavar="HOST:PORT")
@click.option("--store", "store_url", default=None, metavar="URL",
              help="resolve refs in pod annotations through this store (without it, annotations must be digests)")
@click.option("--max-connections", default="256", show_default=True, metavar="N",
              help="connections served at once (a thread each); past it the longest waiting one gives way")
@click.option("--idle-timeout", default="300s", show_default=True, metavar="DURATION",
              help="how long a kept-alive connection may wait for its next request")
@click.option("--request-timeout", default="30s", show_default=True, metavar="DURATION",
              help="from a request's first byte to the end of its answer")
def serve(listen: str, store_url: str | None, max_connections: str, idle_timeout: str, request_timeout: str) -> None:
    """Serve the scheduler: node registration and reports, placement, and the Kubernetes extender."""
    from contextlib import ExitStack

    from overlay.http_bounds import ConnectionBounds
    from overlay.sched_service import SchedService

    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise InputError("expected HOST:PORT", where=f"--listen {listen}")
    if not max_connections.isdigit() or int(max_connections) < 1:
        raise InputError("expected a whole number of connections, at least 1", where=f"--max-connections {max_connections}")
    bounds = ConnectionBounds(max_connections=int(max_connections),
                              idle_seconds=positive(parse_duration, idle_timeout, "--idle-timeout"),
                              request_seconds=positive(parse_duration, request_timeout, "--request-timeout"))
    with ExitStack() as stack:
        resolve = None
        if store_url is not None:
            from dsec_fs.layer import resolve as resolve_ref
            from dsec_fs.store import open_store

            resolve = functools.partial(resolve_ref, stack.enter_context(open_store(store_url)))
        service = SchedService(host=host, port=int(port), resolve=resolve, bounds=bounds)
        click.echo(f"dsecfs scheduler listening on {service.url} (extender at {service.url}/extender)")
        try:
            service.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            service.stop()
