"""The default-directory rule shared by the store and the index mirror."""

import os

import pytest

from dsec_fs.index_mirror import default_index_root
from dsec_fs.paths import default_dir
from dsec_fs.store import default_store_url


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
