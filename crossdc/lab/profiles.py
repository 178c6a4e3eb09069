"""Link profiles: one direction's rate, delay, jitter and burst, and the ``"200mbit,20ms"`` form.

:class:`LinkProfile` is one direction's configuration; :func:`parse_profile` reads the
``"200mbit,20ms"`` form and :data:`PRESETS` names a few typical links.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Direction = Literal["up", "down"]
"""``"up"``: from the connecting side (a site) to the upstream (the coordinator); ``"down"``: back."""

DIRECTIONS: tuple[Direction, Direction] = ("up", "down")

DEFAULT_BURST_BYTES = 64 * 1024
"""Token bucket depth used when a profile does not set ``burst_bytes``."""


# --------------------------------------------------------------------------------------------
# Profiles


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """One direction of an emulated WAN link."""

    rate_bps: float | None
    """Rate cap in bits per second: the fill rate of a token bucket shared by every connection
    of the link in this direction. ``None`` means unlimited."""

    delay_ms: float = 0.0
    """One-way propagation delay in milliseconds added to every byte after the rate cap."""

    jitter_ms: float = 0.0
    """Each released chunk's delay is ``delay_ms`` plus a uniform draw from
    ``[-jitter_ms, +jitter_ms]`` (clipped at 0); a chunk never overtakes an earlier one."""

    burst_bytes: int = DEFAULT_BURST_BYTES
    """Token bucket depth in bytes: the most that can pass at once after the link was idle."""

    seed: int = 0
    """Seed of the jitter RNG; together with the connection's ordinal and the direction it fixes
    the sequence of jitter draws of that connection."""

    def __post_init__(self) -> None:
        if self.rate_bps is not None and not (
            isinstance(self.rate_bps, (int, float))
            and math.isfinite(self.rate_bps)
            and self.rate_bps > 0
        ):
            raise ValueError(
                f"rate_bps must be a finite number > 0, or None for unlimited; got {self.rate_bps!r}"
            )
        for name in ("delay_ms", "jitter_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0; got {value!r}")
        if (
            isinstance(self.burst_bytes, bool)
            or not isinstance(self.burst_bytes, int)
            or self.burst_bytes < 1
        ):
            raise ValueError(f"burst_bytes must be an integer >= 1; got {self.burst_bytes!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer; got {self.seed!r}")

    @property
    def rate_bytes_per_s(self) -> float | None:
        """The rate cap in bytes per second, ``None`` when unlimited."""
        return None if self.rate_bps is None else self.rate_bps / 8.0

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000.0

    @property
    def jitter_s(self) -> float:
        return self.jitter_ms / 1000.0

    def to_spec(self) -> str:
        """The :func:`parse_profile` form of this profile; ``parse_profile(p.to_spec()) == p``."""
        items = [_format_rate(self.rate_bps)]
        if self.delay_ms:
            items.append(f"{_format_number(self.delay_ms)}ms")
        if self.jitter_ms:
            items.append(f"jitter={_format_number(self.jitter_ms)}ms")
        if self.burst_bytes != DEFAULT_BURST_BYTES:
            items.append(f"burst={self.burst_bytes}")
        if self.seed:
            items.append(f"seed={self.seed}")
        return ",".join(items)


UNLIMITED = LinkProfile(rate_bps=None)
"""No rate cap, no delay: a plain forwarding proxy (still useful for fault injection)."""

PRESETS: dict[str, LinkProfile] = {
    "eu": LinkProfile(rate_bps=200e6, delay_ms=20.0),
    "us": LinkProfile(rate_bps=50e6, delay_ms=80.0),
    "ap": LinkProfile(rate_bps=20e6, delay_ms=150.0),
    "lan": UNLIMITED,
}
"""Named links: rate cap and one-way delay per direction (round trip = twice the delay)."""

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_RATE_RE = re.compile(rf"({_NUMBER})\s*([kmgt]?bit)(?:/s)?")
_TIME_RE = re.compile(rf"({_NUMBER})\s*(us|ms|s)")
_SIZE_RE = re.compile(rf"({_NUMBER})\s*(b|k|kb|kib|m|mb|mib)?")
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
_SIZE_UNITS = {
    None: 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
}
_EXAMPLES = "e.g. '200mbit,20ms', '50mbit,80ms,jitter=5ms', 'unlimited' or a preset"


def parse_profile(spec: str) -> LinkProfile:
    """Parse a link spec such as ``"200mbit,20ms"``, ``"50mbit,80ms,jitter=5ms"``, ``"unlimited"``.

    Comma-separated items: a rate (``<n>bit|kbit|mbit|gbit`` with decimal prefixes as in ``tc``,
    optionally ``/s``, or ``unlimited``), a one-way delay (``<n>us|ms|s``), and ``key=value`` items
    ``rate=``, ``delay=``, ``jitter=``, ``burst=`` (bytes; ``k``/``m`` suffixes are binary) and
    ``seed=``. A preset name (:data:`PRESETS`) may stand first, the other items then override it:
    ``"us,jitter=10ms"``. Case does not matter. Raises ``ValueError`` saying what is wrong.
    """
    text = spec.strip().lower()
    if not text:
        raise ValueError(f"bad link profile {spec!r}: empty; {_EXAMPLES} ({', '.join(PRESETS)})")
    base: LinkProfile | None = None
    fields: dict[str, Any] = {}

    def bad(reason: str) -> ValueError:
        return ValueError(f"bad link profile {spec!r}: {reason}; {_EXAMPLES}")

    def put(field_name: str, value: Any) -> None:
        if field_name in fields:
            raise bad(f"{field_name.split('_')[0]} given twice")
        fields[field_name] = value

    for index, raw_item in enumerate(text.split(",")):
        item = raw_item.strip()
        if not item:
            raise bad("empty item")
        if index == 0 and item in PRESETS:
            base = PRESETS[item]
            continue
        if "=" in item:
            key, _, value = (part.strip() for part in item.partition("="))
            put(*_parse_keyed(key, value, bad))
        elif item == "unlimited" or _RATE_RE.fullmatch(item):
            put("rate_bps", _parse_rate(item, bad))
        elif _TIME_RE.fullmatch(item):
            put("delay_ms", _parse_time_ms(item, bad))
        elif item in PRESETS:
            raise bad(f"preset {item!r} must come first")
        elif re.fullmatch(rf"{_NUMBER}\s*[kmgt]?(?:bps|b/s|byte/s)", item):
            raise bad(f"{item!r} is ambiguous: write the rate in bits, e.g. '200mbit'")
        else:
            raise bad(f"cannot read {item!r} as a rate, a delay or key=value")
    if base is None and "rate_bps" not in fields:
        raise bad("no rate given (write 'unlimited' for no rate cap)")
    try:
        if base is None:
            return LinkProfile(**fields)
        return dataclasses.replace(base, **fields)
    except ValueError as exc:
        raise ValueError(f"bad link profile {spec!r}: {exc}") from None


def _parse_keyed(key: str, value: str, bad: Callable[[str], ValueError]) -> tuple[str, Any]:
    """One ``key=value`` item of a link spec, as (:class:`LinkProfile` field, value)."""
    if key == "rate":
        return "rate_bps", _parse_rate(value, bad)
    if key == "delay":
        return "delay_ms", _parse_time_ms(value, bad)
    if key == "jitter":
        return "jitter_ms", _parse_time_ms(value, bad)
    if key == "burst":
        return "burst_bytes", _parse_size(value, bad)
    if key == "seed":
        if not re.fullmatch(r"[+-]?\d+", value):
            raise bad(f"seed must be an integer, got {value!r}")
        return "seed", int(value)
    raise bad(f"unknown key {key!r} (known: rate, delay, jitter, burst, seed)")


def _parse_rate(value: str, bad: Callable[[str], ValueError]) -> float | None:
    if value == "unlimited":
        return None
    match = _RATE_RE.fullmatch(value)
    if match is None:
        raise bad(f"cannot read {value!r} as a rate such as '200mbit' or 'unlimited'")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def _parse_time_ms(value: str, bad: Callable[[str], ValueError]) -> float:
    match = _TIME_RE.fullmatch(value)
    if match is None:
        raise bad(f"cannot read {value!r} as a time such as '20ms'")
    return float(match.group(1)) * _TIME_UNITS_MS[match.group(2)]


def _parse_size(value: str, bad: Callable[[str], ValueError]) -> int:
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise bad(f"cannot read {value!r} as a size in bytes such as '64k'")
    size = float(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size != int(size):
        raise bad(f"burst must be a whole number of bytes, got {value!r}")
    return int(size)


def _format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _format_rate(rate_bps: float | None) -> str:
    if rate_bps is None:
        return "unlimited"
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        count = rate_bps / factor
        if count.is_integer() and int(count) * factor == rate_bps:
            return f"{int(count)}{unit}"
    return f"{_format_number(rate_bps)}bit"
