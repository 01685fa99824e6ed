"""The shared file helpers (dsec_fs.files): private directories."""

import os
import stat

from dsec_fs.files import private_dir


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
