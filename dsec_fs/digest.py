"""Content identities: a chunk, a pack, a blob map and a layer are each named by the sha256 of their bytes.

Digests travel as 32 raw bytes inside binary formats and as 64 lowercase hex characters in object keys,
JSON and messages. ``short()`` gives the 12-character prefix used in log lines.
"""

from __future__ import annotations

import hashlib

from .errors import InputError, IntegrityError

DIGEST_SIZE = 32
HEX_SIZE = 2 * DIGEST_SIZE


def sha256(data: bytes | bytearray | memoryview) -> bytes:
    """Raw sha256 of ``data``; hashlib releases the GIL for large buffers, so worker threads scale."""
    return hashlib.sha256(data).digest()


def to_hex(digest: bytes) -> str:
    return digest.hex()


def from_hex(text: str, *, what: str = "digest") -> bytes:
    """Parse a 64-character lowercase hex digest, naming ``what`` in the error when it is not one."""
    if not is_hex_digest(text):
        raise InputError(f"not a sha256 digest (64 lowercase hex characters): {text[:80]!r}", where=what)
    return bytes.fromhex(text)


def is_hex_digest(text: str) -> bool:
    """True for a digest as keys and JSON spell it: exactly 64 lowercase hex characters."""
    # str.strip at C speed, not a generator a character: a profile's decode checks two a chunk, 100,000
    # chunks an object (a store's 32 such objects took 54 s of a mount's lookup, docs/reliability.md).
    return len(text) == HEX_SIZE and not text.strip(_HEX_DIGITS)


_HEX_DIGITS = "0123456789abcdef"


def short(digest: bytes) -> str:
    return digest.hex()[:12]


def verify(data: bytes | memoryview, expected: bytes, *, what: str) -> None:
    """Raise IntegrityError unless sha256(data) == expected. ``what`` names the object (e.g. 'chunk ab12..')."""
    actual = sha256(data)
    if actual != expected:
        raise IntegrityError(
            f"sha256 mismatch: expected {expected.hex()}, got {actual.hex()} ({len(data)} bytes)", where=what
        )
