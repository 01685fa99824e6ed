"""Fixtures for store tests: a moto S3 server for the session and a fresh s3:// URL per test.

``moto_server`` (session) starts one server on a free port, creates bucket ``S3_TEST_BUCKET`` and stops
the server by PID at the end of the session, whatever the tests did. ``s3_url`` (per test) points the
environment at that server (fake credentials, DSECFS_S3_ENDPOINT) and yields
``s3://dsecfs-test/<unique prefix>``, so tests share the bucket but never see each other's objects.
Self-contained on purpose, so it can move to tests/conftest.py unchanged.
"""

from __future__ import annotations

import secrets

import pytest

from tests.s3server import MotoServer

S3_TEST_BUCKET = "dsecfs-test"


@pytest.fixture(scope="session")
def moto_server():
    with MotoServer() as server:
        server.create_bucket(S3_TEST_BUCKET)
        yield server


@pytest.fixture
def s3_url(moto_server, monkeypatch):
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    return f"s3://{S3_TEST_BUCKET}/t-{secrets.token_hex(6)}"
