"""The node daemon's own HTTP routes: each decodes its request type (dsec_fs/api.py), calls the
NodeDaemon and answers with a response type. overlay/node_service.py adds the sandbox routes the same way.

Threads: handlers run in the daemon's trio thread (http_api.py); what blocks runs in the daemon's calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec_fs import api

from .http_api import HttpApi, Request, Response
from .metrics import MetricsPage

if TYPE_CHECKING:
    from .daemon import NodeDaemon


def register(http: HttpApi, daemon: NodeDaemon) -> None:
    async def get_status(request: Request) -> api.NodeStatus:
        return daemon.status()

    async def get_mounts(request: Request) -> api.MountList:
        return api.MountList(daemon.mounts())

    async def post_mount(request: Request) -> api.MountInfo:
        body = request.decode(api.MountRequest)
        return await daemon.mount(body.layer, body.mountpoint, mode=body.mode, store_url=body.store,
                                  prefetch=body.prefetch, fuse_binding=body.fuse_binding, profile=body.profile,
                                  name=body.name, fill=body.fill)

    async def post_umount(request: Request) -> api.UmountInfo:
        body = request.decode(api.UmountRequest)
        return api.UmountInfo(await daemon.unmount(body.mountpoint, lazy=body.lazy))

    async def get_prefetch(request: Request) -> api.PrefetchList:
        return api.PrefetchList(daemon.prefetches())

    async def post_prefetch(request: Request) -> api.PrefetchInfo:
        body = request.decode(api.PrefetchRequest)
        return await daemon.prefetch(body.mountpoint, body.list)

    async def get_cache(request: Request) -> api.CacheInfo:
        return daemon.cache_status()

    async def post_evict(request: Request) -> api.CacheInfo:
        return await daemon.evict(request.decode(api.EvictRequest).to)


    http.route("GET", "/v1/status", get_status)
    http.route("GET", "/v1/mounts", get_mounts)
    http.route("POST", "/v1/mounts", post_mount)
    http.route("POST", "/v1/umount", post_umount)
    http.route("GET", "/v1/prefetch", get_prefetch)
    http.route("POST", "/v1/prefetch", post_prefetch)
    http.route("GET", "/v1/cache", get_cache)
    http.route("POST", "/v1/cache/evict", post_evict)
    register_metrics(http, daemon)


def register_metrics(http: HttpApi, daemon: NodeDaemon, *, shared: bool = False) -> None:
    """GET /metrics: the Prometheus text (also served alone on TCP with ``--metrics-address``); ``shared``:
    the page rendered at most once per metrics.SHARED_PAGE_SECONDS, for a port anyone may reach."""
    render = daemon.metrics.shared if shared else daemon.metrics.render

    async def get_metrics(request: Request) -> Response:
        return Response(200, render(), MetricsPage.content_type)

    http.route("GET", "/metrics", get_metrics)
