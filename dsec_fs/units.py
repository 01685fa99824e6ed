"""Byte sizes as people write and read them (binary units), for commands and reports."""

from __future__ import annotations

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
