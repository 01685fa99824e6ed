"""Opening stores from the command line: read-only commands never create one, a missing store is an
error naming its URL, URLs are parsed strictly, ``store init`` and a first build create one, and the
AWS-style --endpoint-url/--profile/--region flags reach S3 (moto over HTTP)."""

from __future__ import annotations

import os
import secrets

import pytest
from cli_support import build, dsecfs, dsecfs_process, json_of
from treecmp import write_files

READ_ONLY = [
    ("inspect", "base:1"), ("fsck", "base:1"), ("diff", "base:1", "base:2"), ("ref", "ls"), ("store", "stats"),
    ("gc", "--dry-run"), ("gc",), ("ref", "rm", "base:1"),
]


@pytest.mark.parametrize("command", READ_ONLY, ids=lambda c: " ".join(c))
def test_a_command_on_a_missing_store_fails_naming_it_and_creates_nothing(tmp_path, command):
    store = tmp_path / "typo" / "store"
    result = dsecfs(*command, "--store", str(store))
    assert result.exit_code == 6, result.output
    assert f"file://{store}" in result.stderr and "no such store" in result.stderr
    assert "dsecfs store init" in result.stderr
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("command", [("extract", "base:1", "OUT"), ("export", "base:1", "OUT")])
def test_export_and_extract_of_a_missing_store_create_nothing(tmp_path, command):
    store = tmp_path / "missing"
    args = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    result = dsecfs(*args, "--store", str(store))
    assert result.exit_code == 6 and f"file://{store}" in result.stderr
    assert not store.exists()


@pytest.mark.parametrize("url, complaint", [
    ("posix://tmp/x", "posix:///tmp/x"), ("file://relative/dir", "file:///relative/dir"),
    ("nfs://host/x", "unknown scheme"), ("s3://Bad_Bucket/x", "bad bucket name"), ("s3:///prefix", "bad bucket"),
])
def test_a_malformed_url_is_an_input_error_and_nothing_appears_in_the_working_directory(tmp_path, monkeypatch, url,
                                                                                          complaint):
    monkeypatch.chdir(tmp_path)
    for command in (("inspect", "base:1"), ("build", str(write_files(tmp_path / "src", {"f": b"x"})))):
        result = dsecfs(*command, "--store", url)
        assert result.exit_code == 2, result.output
        assert complaint in result.stderr and url in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_relative_path_is_a_store_below_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    digest = build(write_files(tmp_path / "src", {"f": b"x"}), "stores/one")
    assert (tmp_path / "stores" / "one" / "layers" / digest / "manifest.json").is_file()


def test_build_creates_a_store_on_first_use_and_says_so(tmp_path):
    src = write_files(tmp_path / "src", {"f": b"data"})
    store = tmp_path / "new-store"
    first = dsecfs("build", src, "--store", str(store), "--name", "a:1")
    assert first.exit_code == 0, first.output
    assert f"created store file://{store}" in first.stderr
    second = dsecfs("build", src, "--store", str(store), "--name", "a:2")
    assert second.exit_code == 0 and "created store" not in second.stderr
    assert "created store" not in dsecfs("build", src, "--store", str(tmp_path / "s2"), "--json").stderr


def test_store_init_creates_a_directory_store_once(tmp_path):
    store = tmp_path / "a" / "store"
    first = dsecfs("store", "init", f"posix://{store}", "--json")
    assert first.exit_code == 0, first.output
    assert json_of(first) == {"store": f"posix://{store}", "created": True}
    assert store.is_dir()
    again = dsecfs("store", "init", "--store", str(store))
    assert again.exit_code == 0 and "already there" in again.stdout
    stats = dsecfs("store", "stats", "--store", str(store), "--json")
    assert stats.exit_code == 0 and json_of(stats)["layers"] == 0


@pytest.mark.s3
def test_an_endpoint_without_a_scheme_is_a_clear_error_not_a_traceback(s3_url):
    done = dsecfs_process("inspect", "base:1", "--store", s3_url, env={"DSECFS_S3_ENDPOINT": "127.0.0.1:9000"})
    assert done.returncode == 2, done.stderr
    assert "must be an http:// or https:// URL" in done.stderr and "'127.0.0.1:9000'" in done.stderr
    assert "Traceback" not in done.stderr
    flag = dsecfs_process("ref", "ls", "--store", s3_url, "--endpoint-url", "localhost:1")
    assert flag.returncode == 2 and "Traceback" not in flag.stderr


@pytest.mark.s3
def test_the_endpoint_region_and_profile_flags_reach_s3(tmp_path, moto_server, s3_url):
    src = write_files(tmp_path / "src", {"f": b"over s3"})
    without_endpoint = {"DSECFS_S3_ENDPOINT": "", "AWS_ENDPOINT_URL": ""}
    bucket = f"init-{secrets.token_hex(4)}"
    flags = ["--endpoint-url", moto_server.url, "--region", "eu-west-1"]
    made = dsecfs_process("store", "init", f"s3://{bucket}/p", *flags, "--json", env=without_endpoint)
    assert made.returncode == 0, made.stderr
    assert json_of(made) == {"store": f"s3://{bucket}/p", "created": True}
    built = dsecfs_process("build", src, "--store", f"s3://{bucket}/p", "--name", "a:1", *flags, "-q",
                           env=without_endpoint)
    assert built.returncode == 0 and built.stderr == "", built.stderr  # botocore's INFO lines stay out
    listed = dsecfs_process("ref", "ls", "--store", f"s3://{bucket}/p", "--json", *flags, env=without_endpoint)
    assert json_of(listed)["refs"] == {"a:1": built.stdout.strip()}
    again = dsecfs_process("store", "init", f"s3://{bucket}/p", *flags, env=without_endpoint)
    assert again.returncode == 0 and "already there" in again.stdout

    profiled = dsecfs_process("ref", "ls", "--store", s3_url, "--profile", "no-such-profile")
    assert profiled.returncode == 2 and "no-such-profile" in profiled.stderr and "Traceback" not in profiled.stderr


@pytest.mark.s3
def test_a_missing_bucket_names_it_and_is_not_created_by_reading(moto_server, s3_url):
    bucket = f"absent-{secrets.token_hex(4)}"
    done = dsecfs_process("inspect", "base:1", "--store", f"s3://{bucket}/x")
    assert done.returncode == 5 and f"bucket {bucket} does not exist" in done.stderr
    again = dsecfs_process("ref", "ls", "--store", f"s3://{bucket}/x")
    assert again.returncode == 5, again.stderr
