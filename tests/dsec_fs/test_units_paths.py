"""Sizes, durations (dsec_fs.units) and the default-directory rule (dsec_fs.paths)."""

import os

import pytest

from dsec_fs.errors import InputError
from dsec_fs.index_mirror import default_index_root
from dsec_fs.paths import default_dir
from dsec_fs.store import default_store_url
from dsec_fs.units import human_size, parse_duration, parse_size


def test_the_environment_variable_wins(monkeypatch):
    monkeypatch.setenv("DSECFS_STORE", "s3://bucket/prefix")
    monkeypatch.setenv("DSECFS_INDEX_DIR", "/somewhere/index")
    assert default_store_url() == "s3://bucket/prefix"
    assert default_index_root() == "/somewhere/index"


def test_root_gets_the_system_paths(monkeypatch):
    monkeypatch.delenv("DSECFS_STORE", raising=False)
    monkeypatch.delenv("DSECFS_INDEX_DIR", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_store_url() == "/var/lib/dsecfs/store"
    assert default_index_root() == "/var/cache/dsecfs/index"


@pytest.mark.parametrize("xdg", [None, "/xdg/base"])
def test_other_users_get_their_xdg_directories(monkeypatch, tmp_path, xdg):
    monkeypatch.delenv("DSECFS_STORE", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("HOME", str(tmp_path))
    if xdg is None:
        monkeypatch.delenv("XDG_DATA_HOME", raising=False)
        expected = os.path.join(str(tmp_path), ".local/share/dsecfs/store")
    else:
        monkeypatch.setenv("XDG_DATA_HOME", xdg)
        expected = "/xdg/base/dsecfs/store"
    assert default_store_url() == expected
    assert default_dir("UNSET_FOR_TEST", "/var/x", "XDG_CACHE_HOME_UNSET", "~/.cache", "x") == \
        os.path.join(str(tmp_path), ".cache/dsecfs/x")


@pytest.mark.parametrize("text, seconds", [("0s", 0), ("90", 90), ("30m", 1800), ("1h", 3600),
                                           ("1h30m", 5400), ("2d", 172800), ("1.5h", 5400), ("1W", 604800)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1x", "-1h", "1h 30m", "1hh"])
def test_bad_durations_name_the_text(text):
    with pytest.raises(InputError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("text, size", [("4096", 4096), ("64K", 65536), ("1MiB", 1 << 20), ("2g", 2 << 30)])
def test_sizes(text, size):
    assert parse_size(text) == size
    assert human_size(size) in ("4.0 KiB", "64.0 KiB", "1.0 MiB", "2.0 GiB")


@pytest.mark.parametrize("text, size", [
    ("1.5G", 3 << 29), ("1.5GiB", 3 << 29), ("0.5 MiB", 1 << 19), (".5k", 512),
    ("1GB", 10**9), ("100MB", 10**8), ("1kb", 1000), ("2TB", 2 * 10**12), ("1Ki", 1024), ("10B", 10),
    ("1.0001KB", 1000), ("7", 7),
])
def test_sizes_take_decimals_and_both_kinds_of_unit(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "K", "twelve", "-1K", "1.5.2M", "1 K B", "1KiBB", "1X", "1e3"])
def test_bad_sizes_name_the_text(text):
    with pytest.raises(InputError, match="not a size"):
        parse_size(text)
