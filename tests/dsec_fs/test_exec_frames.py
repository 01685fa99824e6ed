"""The frames of an attached command (dsec_fs/exec_frames.py): both sides parse what the other frames,
byte by byte or all at once, and refuse what no honest peer sends."""

from __future__ import annotations

import struct

import pytest

from dsec_fs import exec_frames
from dsec_fs.errors import InputError
from dsec_fs.exec_frames import FrameParser


def test_frames_come_back_whole_however_the_bytes_are_split():
    frames = [(exec_frames.STDIN, b"abc"), (exec_frames.STDIN_EOF, b""), (exec_frames.STDIN, bytes(range(256)) * 256)]
    data = b"".join(exec_frames.frame(kind, payload) for kind, payload in frames) + exec_frames.resize_frame(40, 100)
    for step in (1, 7, len(data)):
        parser = FrameParser({exec_frames.STDIN, exec_frames.STDIN_EOF, exec_frames.RESIZE})
        got = [item for start in range(0, len(data), step) for item in parser.feed(data[start:start + step])]
        assert got[:3] == frames and exec_frames.parse_size(got[3][1]) == (40, 100) and parser.pending == 0


@pytest.mark.parametrize("header, message", [
    (struct.pack(">BI", exec_frames.STDIN, exec_frames.MAX_PAYLOAD + 1), "at most"),
    (struct.pack(">BI", exec_frames.STDIN, 0xFFFFFFFF), "at most"),
    (struct.pack(">BI", exec_frames.STDOUT, 1), "unknown kind"),  # the daemon's kind, from a client
    (struct.pack(">BI", 0, 0), "unknown kind"),
])
def test_a_refused_header_is_an_error_before_its_payload_is_waited_for(header, message):
    parser = FrameParser({exec_frames.STDIN, exec_frames.STDIN_EOF, exec_frames.RESIZE})
    with pytest.raises(InputError, match=message):
        list(parser.feed(header))


def test_a_sender_cannot_frame_more_than_the_bound_and_sizes_are_checked():
    with pytest.raises(InputError):
        exec_frames.frame(exec_frames.STDOUT, bytes(exec_frames.MAX_PAYLOAD + 1))
    with pytest.raises(InputError):
        exec_frames.parse_size(b"\0\0\0")
