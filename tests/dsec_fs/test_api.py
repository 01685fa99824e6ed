"""The API defined once (dsec_fs/api.py): the routes the daemon serves are exactly api.ROUTES, requests
are checked field by field, and docs/openapi.json is what api.openapi() makes."""

from __future__ import annotations

import json
import os

import pytest

from dsec_fs import api
from dsec_fs.errors import InputError, UnavailableError

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "openapi.json")


def test_the_daemon_serves_exactly_the_routes_the_api_defines(tmp_path):
    from lazy_fetch.daemon import DaemonOptions, NodeDaemon
    from overlay import node_service

    daemon = NodeDaemon(DaemonOptions(socket_path=str(tmp_path / "s"), state_dir=str(tmp_path / "state"),
                                      cache_dir=str(tmp_path / "cache")))
    node_service.attach(daemon)
    assert sorted(daemon.api.routes()) == sorted((e.method, e.path) for e in api.ROUTES)


def test_docs_openapi_json_is_current():
    with open(DOCS) as f:
        assert json.load(f) == json.loads(json.dumps(api.openapi())), \
            "docs/openapi.json is stale: .venv/bin/python -m dsec_fs.api > docs/openapi.json"


@pytest.mark.parametrize("body, field", [
    (b'{"layer": 3, "mountpoint": "/m"}', "$.layer"),
    (b'{"mountpoint": "/m"}', "layer"),
    (b'{"layer": "a", "mountpoint": "/m", "prefetch_list": "/p"}', "prefetch_list"),
    (b'{"layer": "a", "mountpoint": "' + b"x" * (api.MAX_PATH + 1) + b'"}', "$.mountpoint"),
    (b'[1, 2]', "object"),
    (b'{"layer": "a", "mountpoint": "/m"', "truncated"),
])
def test_a_bad_request_is_one_input_error_naming_the_field(body, field):
    with pytest.raises(InputError) as error:
        api.decode(body, api.MountRequest, where="POST /v1/mounts")
    assert field.lower() in str(error.value).lower()


def test_an_answer_keeps_working_with_fields_a_newer_daemon_adds_and_refuses_a_wrong_one():
    info = api.decode({"pid": 7, "from_the_future": [1], "cache": {"hits": 2, "new": 1}}, api.NodeStatus, where="t")
    assert (info.pid, info.cache.hits) == (7, 2)
    with pytest.raises(UnavailableError, match="NodeStatus"):
        api.decode({"pid": "seven"}, api.NodeStatus, where="t")


def test_errors_travel_as_one_format_and_come_back_as_their_class():
    sent = api.error_body(UnavailableError("the store hangs", where="packs/ab/cd", transient=True))
    back = api.error_from_body(sent, api.STATUS_BY_KIND["unavailable"], "GET /v1/status")
    assert isinstance(back, UnavailableError) and back.transient and back.where == "packs/ab/cd"
    assert api.decode(sent, api.ErrorBody, where="t").error == "unavailable"
