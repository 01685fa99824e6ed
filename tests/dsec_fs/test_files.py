"""The shared file helpers: private directories (dsec_fs.files), removing trees nested any depth (dsec_fs.trees)."""

import os
import stat

import pytest

from dsec_fs.files import private_dir
from dsec_fs.mounts import mount, umount
from dsec_fs.trees import remove_tree


def test_a_private_dir_is_made_0700_and_narrowed_when_found_wider(tmp_path, caplog):
    made = tmp_path / "a" / "state"
    assert private_dir(made) == str(made)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "kept").write_bytes(b"x")
    os.chmod(wide, 0o755)
    assert "narrowed" not in caplog.text
    private_dir(str(wide))
    assert stat.S_IMODE(wide.stat().st_mode) == 0o700 and (wide / "kept").read_bytes() == b"x"
    assert "narrowed to 0700" in caplog.text


def _nest(top, depth: int) -> None:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            with open(os.open("f", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd), "wb") as f:
                f.write(b"x")
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
    finally:
        os.close(fd)


def test_a_tree_nested_deeper_than_pythons_stack_is_removed_and_symlinks_are_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_bytes(b"kept")
    top = tmp_path / "top"
    top.mkdir()
    _nest(top, 3000)  # shutil.rmtree raised RecursionError here, ignore_errors or not
    (top / "link").symlink_to(outside)
    (top / "file-link").symlink_to(outside / "kept")
    for i in range(100):
        (top / f"wide{i}").mkdir()
    remove_tree(top)
    assert not top.exists() and (outside / "kept").read_bytes() == b"kept"
    remove_tree(top)  # gone already: done


@pytest.mark.root
def test_a_filesystem_mounted_below_is_left_whole_and_said(tmp_path):
    top = tmp_path / "top"
    (top / "a" / "mnt").mkdir(parents=True)
    (top / "b").mkdir()
    (top / "b" / "gone").write_bytes(b"x")
    mount("tmpfs", str(top / "a" / "mnt"), "tmpfs")
    try:
        (top / "a" / "mnt" / "kept").write_bytes(b"kept")
        with pytest.raises(OSError):
            remove_tree(top)
        assert (top / "a" / "mnt" / "kept").read_bytes() == b"kept" and not (top / "b").exists()
    finally:
        umount(str(top / "a" / "mnt"))
    remove_tree(top)
    assert not top.exists()
