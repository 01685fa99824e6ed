"""``dsecfs ref ls|tag|rm`` and naming layers by digest prefix or ``sha256:`` on the command line, on a
directory store, a posix:// one and S3 (moto over HTTP)."""

from __future__ import annotations

import pytest
from cli_support import build, dsecfs, dsecfs_process, json_of
from treecmp import write_files

from dsec_fs.layer import list_refs
from dsec_fs.store import init_store, open_store
from tests.dsec_fs.layer_support import two_layers_sharing_a_prefix


@pytest.fixture(params=["path", "posix", pytest.param("s3", marks=pytest.mark.s3)])
def store_url(request, tmp_path):
    if request.param == "s3":
        return request.getfixturevalue("s3_url")
    root = tmp_path / "store"
    return str(root) if request.param == "path" else f"posix://{root}"


@pytest.fixture
def two_layers(tmp_path, store_url):
    a = build(write_files(tmp_path / "a", {"etc/a": b"a" * 5000}), store_url, "--name", "base/a:1")
    b = build(write_files(tmp_path / "b", {"etc/b": b"b" * 5000}), store_url, "--name", "base/b:1")
    return a, b


def test_ref_ls_tag_rm(store_url, two_layers):
    a, b = two_layers
    listed = dsecfs("ref", "ls", "--store", store_url)
    assert listed.exit_code == 0, listed.output
    assert listed.stdout.splitlines()[1:] == [f"base/a:1  {a[:12]}", f"base/b:1  {b[:12]}"]
    assert f"base/a:1  {a}" in dsecfs("ref", "ls", "--no-trunc", "--store", store_url).stdout

    tagged = dsecfs("ref", "tag", a[:12], "ws/task:v2", "--store", store_url, "--json")
    assert tagged.exit_code == 0, tagged.output
    assert json_of(tagged)["layer"] == a and json_of(tagged)["ref"] == "ws/task:v2"
    assert dsecfs("ref", "tag", "base/b:1", "ws/task:v2", "--store", store_url).exit_code == 0  # moves it
    with open_store(store_url) as store:
        assert list_refs(store) == {"base/a:1": a, "base/b:1": b, "ws/task:v2": b}

    removed = dsecfs("ref", "rm", "ws/task:v2", "base/a:1", "--store", store_url, "--json")
    assert removed.exit_code == 0, removed.output
    assert json_of(removed)["removed"] == [{"ref": "ws/task:v2", "layer": b}, {"ref": "base/a:1", "layer": a}]
    assert json_of(dsecfs("ref", "ls", "--store", store_url, "--json"))["refs"] == {"base/b:1": b}


def test_ref_rm_of_a_missing_ref_fails_naming_it_and_the_store(store_url, two_layers):
    result = dsecfs("ref", "rm", "base/nope:1", "--store", store_url)
    assert result.exit_code == 6
    assert "base/nope:1" in result.stderr and "no such ref in store" in result.stderr
    assert "base/nope:1" in result.stderr


def test_ref_tag_refuses_a_bad_name_and_an_unknown_layer(store_url, two_layers):
    assert dsecfs("ref", "tag", "base/a:1", "Bad Name", "--store", store_url).exit_code == 2
    missing = dsecfs("ref", "tag", "sha256:" + "0" * 64, "x:1", "--store", store_url)
    assert missing.exit_code == 6 and "not published" in missing.stderr


def test_every_command_takes_a_short_digest_and_sha256(tmp_path, store_url, two_layers):
    a, b = two_layers
    for name in (a[:12], f"sha256:{a}", f"sha256:{a[:12]}", a):
        shown = dsecfs("inspect", name, "--store", store_url, "--json")
        assert shown.exit_code == 0, (name, shown.output)
        assert json_of(shown)["layer"] == a
    assert dsecfs("fsck", a[:12], "--store", store_url).exit_code == 0
    diff = dsecfs("diff", a[:12], f"sha256:{b[:12]}", "--store", store_url, "--json")
    assert diff.exit_code == 0, diff.output
    assert json_of(diff)["added"] == ["/etc/b"]
    extracted = dsecfs("extract", f"sha256:{b[:10]}", str(tmp_path / "out"), "--store", store_url, "--json")
    assert extracted.exit_code == 0, extracted.output
    assert json_of(extracted)["layer"] == b
    assert (tmp_path / "out" / "etc" / "b").read_bytes() == b"b" * 5000
    exported = dsecfs("export", b[:12], str(tmp_path / "exp"), "--store", store_url, "--json")
    assert exported.exit_code == 0 and json_of(exported)["layer"] == b
    rebuilt = dsecfs("build", str(tmp_path / "a"), "--store", store_url, "--parent", a[:12], "--json")
    assert rebuilt.exit_code == 0, rebuilt.output
    assert json_of(rebuilt)["layer"] == a


def test_an_ambiguous_prefix_fails_listing_the_candidates(store_url):
    with init_store(store_url)[0] as store:
        a, b = two_layers_sharing_a_prefix(store)
    result = dsecfs("ref", "tag", a[:4], "x:1", "--store", store_url)
    assert result.exit_code == 2
    assert "ambiguous" in result.stderr and a in result.stderr and b in result.stderr
    assert dsecfs("ref", "tag", a[:12], "x:1", "--store", store_url).exit_code == 0


def test_a_prefix_is_refused_as_a_digest_by_the_process_too(tmp_path):
    """The installed command (a process of its own) says what it looked for; exit 6, not a traceback."""
    store = str(tmp_path / "store")
    digest = build(write_files(tmp_path / "t", {"f": b"x"}), store)
    absent = next(p for p in ("0000", "ffff") if not digest.startswith(p))
    done = dsecfs_process("inspect", f"sha256:{absent}", "--store", store)
    assert done.returncode == 6, done.stderr
    assert f"starts with {absent}" in done.stderr and "Traceback" not in done.stderr
