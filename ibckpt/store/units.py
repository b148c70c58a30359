"""Parsing and formatting of sizes and durations given on command lines and in environment variables."""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """`8MiB`, `8M` (decimal), `1.5GiB`, `4096` -> bytes."""
    match = _NUMBER_UNIT.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 8MiB, 2GiB, 500MB)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `6h`, `7d`, `2w` -> seconds. Several parts add up: `1h30m`."""
    parts = re.findall(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)", text)
    rebuilt = "".join(number + unit for number, unit in parts)
    if not parts or rebuilt != re.sub(r"\s+", "", text):
        raise ValueError(f"not a duration: {text!r} (examples: 90s, 15m, 6h, 7d)")
    total = 0.0
    for number, unit in parts:
        if unit.lower() not in _DURATION_UNITS:
            raise ValueError(f"not a duration: {text!r} (units: s, m, h, d, w)")
        total += float(number) * _DURATION_UNITS[unit.lower()]
    return total


def format_size(size: float) -> str:
    """Bytes in binary units, 3 significant digits: 1.50 GiB, 50.0 MiB, 1000 MiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} B"
            decimals = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
            return f"{value:.{decimals}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
