"""Byte sizes (binary units) and durations as people write and read them, for commands and reports."""

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


def parse_size(text: str) -> int:
    """Bytes from '4096', '64K', '1MiB', '2g' (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    spelled = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(spelled[-1:], 1)
    try:
        return int(spelled[:-1] if scale > 1 else spelled) * scale
    except ValueError:
        raise InputError(f"not a size: {text!r} (use e.g. 4096, 64K, 1MiB, 2G)") from None


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)([smhdw]?)")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``90``, ``0s``, ``30m``, ``1h``, ``2d``, ``1w`` or sums such as ``1h30m``."""
    spelled = text.strip().lower()
    parts = list(_DURATION_PART.finditer(spelled))
    if not spelled or "".join(m.group(0) for m in parts) != spelled:
        raise InputError(f"not a duration: {text!r} (use e.g. 0s, 30m, 1h, 2d or 1h30m)")
    return sum(float(m.group(1)) * _DURATION_UNITS[m.group(2)] for m in parts)
