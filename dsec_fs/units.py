"""Byte sizes and durations as people write and read them, for commands and reports."""

from __future__ import annotations

import re

from .errors import InputError


def human_size(n: float) -> str:
    """1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtpe])(i?)b?|b)?", re.IGNORECASE)
_SIZE_POWERS = "kmgtpe"


def parse_size(text: str) -> int:
    """Bytes in ``text``, one syntax for every size dsecfs reads (as GNU coreutils spells them): a number,
    decimals allowed, then nothing or B (bytes), KB MB GB TB (powers of 1000), KiB MiB GiB TiB or K M G T
    (powers of 1024); case does not matter. ``1.5G`` is 1.5 GiB, ``100MB`` is 10^8; rounded to a byte."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise InputError(f"not a size: {text!r} (use e.g. 4096, 64K, 1.5GiB, 100MB)")
    number, letter, binary = match.groups()
    scale = 1
    if letter:
        power = _SIZE_POWERS.index(letter.lower()) + 1
        decimal = match.group(0).lower().endswith("b") and not binary
        scale = 1000 ** power if decimal else 1024 ** power
    if number.isdigit():  # the usual case, without importing decimal (each command start pays for it)
        return int(number) * scale
    from decimal import Decimal

    return round(Decimal(number) * scale)


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)([smhdw]?)")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``90``, ``0s``, ``30m``, ``1h``, ``2d``, ``1w`` or sums such as ``1h30m``."""
    spelled = text.strip().lower()
    parts = list(_DURATION_PART.finditer(spelled))
    if not spelled or "".join(m.group(0) for m in parts) != spelled:
        raise InputError(f"not a duration: {text!r} (use e.g. 0s, 30m, 1h, 2d or 1h30m)")
    return sum(float(m.group(1)) * _DURATION_UNITS[m.group(2)] for m in parts)
