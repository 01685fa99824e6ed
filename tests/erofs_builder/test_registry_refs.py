"""Registry references and credentials (erofs_builder.registry), without a registry: how names parse,
which auth file entry a host gets."""

from __future__ import annotations

import base64
import json

import pytest

from dsec_fs.errors import InputError
from erofs_builder.registry import ImageRef, load_credentials, parse_image_ref

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("text, expected", [
    ("docker://127.0.0.1:5000/test/img:v1", ImageRef("127.0.0.1:5000", "test/img", "v1", None)),
    ("docker://localhost/img", ImageRef("localhost", "img", "latest", None)),
    ("docker://registry.example/a/b/c@" + DIGEST, ImageRef("registry.example", "a/b/c", None, DIGEST)),
    ("docker://reg.example:443/a:t@" + DIGEST, ImageRef("reg.example:443", "a", "t", DIGEST)),
    ("docker://debian:12", ImageRef("docker.io", "library/debian", "12", None)),
    ("docker://someone/tool", ImageRef("docker.io", "someone/tool", "latest", None)),
])  # fmt: skip
def test_references_parse(text, expected):
    ref = parse_image_ref(text)
    assert ref == expected
    assert ref.reference == (expected.digest or expected.tag)
    assert parse_image_ref(str(ref)) == ref


@pytest.mark.parametrize("text", [
    "docker://host:5000/Upper/case", "docker://host:5000/img@sha256:short", "docker://host:5000/img@md5:" + "0" * 32,
    "docker://host:5000/img:bad/tag:x", "docker://host:5000/img:-dash", "docker://host:5000/../etc",
])  # fmt: skip
def test_bad_references_are_input_errors(text):
    with pytest.raises(InputError):
        parse_image_ref(text)


def test_credentials_come_from_the_first_file_with_an_entry(tmp_path):
    encoded = base64.b64encode(b"user:pa:ss").decode()
    first = tmp_path / "auth.json"
    first.write_text(json.dumps({"auths": {"other:5000": {"auth": base64.b64encode(b"x:y").decode()}}}))
    second = tmp_path / "config.json"
    second.write_text(json.dumps({"auths": {"https://reg.example:5000/v1/": {"auth": encoded},
                                            "https://index.docker.io/v1/": {"username": "hub", "password": "pw"}}}))
    files = [str(tmp_path / "missing.json"), str(first), str(second)]
    assert load_credentials("reg.example:5000", files) == ("user", "pa:ss")
    assert load_credentials("other:5000", files) == ("x", "y")
    assert load_credentials("docker.io", files) == ("hub", "pw")
    assert load_credentials("nowhere:1", files) is None


def test_a_broken_auth_file_is_an_input_error_naming_it(tmp_path):
    broken = tmp_path / "auth.json"
    broken.write_text("{not json")
    with pytest.raises(InputError, match="auth.json"):
        load_credentials("reg.example", [str(broken)])
    broken.write_text(json.dumps({"auths": {"reg.example": {"auth": "%%%"}}}))
    with pytest.raises(InputError, match="not base64"):
        load_credentials("reg.example", [str(broken)])


def test_a_plain_http_token_realm_is_refused_for_a_tls_registry():
    """The login would go over plain HTTP: refused before anything is sent (the realm's port is closed)."""
    from dsec_fs.errors import UnavailableError
    from erofs_builder.registry import RegistryClient, RegistryOptions

    client = RegistryClient("reg.example", RegistryOptions(credentials=("user", "pw")))
    with pytest.raises(UnavailableError, match="token realm 'http://127.0.0.1:9/token' is not https") as refused:
        client._token({"realm": "http://127.0.0.1:9/token", "service": "s"}, "repository:a:pull", "reg.example")
    assert not refused.value.transient
