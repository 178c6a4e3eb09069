"""The masking math of secure aggregation: fixed point, pairwise keys, mask streams.

:class:`SecAggConfig` fixes the fixed-point encoding (``frac_bits``, ``word_bits``) and the
bounds that keep a sum from wrapping; a pair of sites derives its key through X25519 and
HKDF-SHA256 (:func:`x25519_from_curve_secret`, :class:`Peer`) and its mask vector per tensor
name from a ChaCha20 keystream (:func:`mask_stream`). The protocol is in ``comm.security.secagg``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq.utils.z85 as z85
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from comm.security.common import curve_raw

WEIGHT_KEY = "__secagg_weight__"
"""Reserved tensor name carrying a site's weight inside its masked vectors."""

_HKDF_SALT = b"crossdc-secagg-v1"

MaskedArrays = dict[str, npt.NDArray[np.unsignedinteger[Any]]]


@dataclass(frozen=True, kw_only=True)
class SecAggConfig:
    """Fixed-point encoding and protocol limits; the coordinator and all sites must agree."""

    clip_bound: float
    """Largest magnitude of any weighted value ``w * x`` a site may mask (e.g. the DP clip norm,
    which bounds every coordinate of an L2-clipped update)."""
    frac_bits: int = 32
    """Fractional bits of the fixed-point encoding: resolution 2^-frac_bits."""
    word_bits: int = 64
    """k: arithmetic modulo 2^k on uint64 (64) or uint32 (32, half the bytes, less headroom)."""
    max_sites: int = 256
    """Most sites in one masking set; with ``clip_bound`` it sizes the overflow headroom."""
    min_sites: int = 2
    """Fewest sites a site will mask with (fewer would show one update as the sum)."""
    max_attempts: int = 3
    """Attempts per round: the first plus at most ``max_attempts - 1`` re-runs after dropouts."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_bound) and self.clip_bound > 0):
            raise ValueError(f"secagg.clip_bound must be a positive number, got {self.clip_bound}")
        if self.word_bits not in (32, 64):
            raise ValueError(f"secagg.word_bits must be 32 or 64, got {self.word_bits}")
        if not 0 <= self.frac_bits < self.word_bits - 1:
            raise ValueError(
                f"secagg.frac_bits must be in [0, {self.word_bits - 1}), got {self.frac_bits}"
            )
        if self.min_sites < 2:
            raise ValueError(f"secagg.min_sites must be >= 2, got {self.min_sites}")
        if self.max_sites < self.min_sites:
            raise ValueError("secagg.max_sites must be >= secagg.min_sites")
        if self.max_attempts < 1:
            raise ValueError(f"secagg.max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_sites * self.max_encoded > 2 ** (self.word_bits - 1) - 1:
            raise ValueError(
                f"secagg.clip_bound={self.clip_bound} with frac_bits={self.frac_bits} and "
                f"max_sites={self.max_sites} could overflow {self.word_bits}-bit sums: lower "
                "clip_bound, frac_bits or max_sites, or use word_bits = 64"
            )

    @property
    def max_encoded(self) -> int:
        """Largest magnitude of one encoded value (values, and weights up to 1)."""
        return math.floor(max(self.clip_bound, 1.0) * 2.0**self.frac_bits) + 1

    @property
    def dtype(self) -> np.dtype[np.unsignedinteger[Any]]:
        return np.dtype(np.uint64 if self.word_bits == 64 else np.uint32)

    @property
    def signed_dtype(self) -> np.dtype[np.signedinteger[Any]]:
        return np.dtype(np.int64 if self.word_bits == 64 else np.int32)


# ---------------------------------------------------------------------------------------------
# Fixed point


def encode_fixed(
    name: str, values: npt.ArrayLike, config: SecAggConfig
) -> npt.NDArray[np.unsignedinteger[Any]]:
    """``rint(v * 2^frac_bits)`` modulo 2^k; ValueError if non-finite or beyond ``clip_bound``."""
    x = np.asarray(values, dtype=np.float64)
    if x.size:
        if not np.isfinite(x).all():
            raise ValueError(f"secagg: tensor {name!r} holds NaN or Inf")
        peak = float(np.abs(x).max())
        if peak > config.clip_bound:
            raise ValueError(
                f"secagg: tensor {name!r} has |value| {peak:.6g} > clip_bound {config.clip_bound}"
                " (clip the update first)"
            )
    # ldexp by a power of two is exact; rint is exact below 2^53; the int64 -> uint cast is
    # reduction modulo 2^k (two's complement).
    fixed = np.asarray(np.rint(np.ldexp(x, config.frac_bits))).astype(np.int64)
    return fixed.astype(config.dtype)


def to_signed(
    sums: npt.NDArray[np.unsignedinteger[Any]], config: SecAggConfig
) -> npt.NDArray[np.int64]:
    """Residues modulo 2^k as the signed integers they encode."""
    return np.asarray(sums, order="C").view(config.signed_dtype).astype(np.int64)


def decode_fixed(
    sums: npt.NDArray[np.unsignedinteger[Any]], config: SecAggConfig
) -> npt.NDArray[np.float64]:
    return np.ldexp(to_signed(sums, config).astype(np.float64), -config.frac_bits)


# ---------------------------------------------------------------------------------------------
# Keys


def x25519_public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def x25519_from_curve_secret(secret_z85: bytes) -> X25519PrivateKey:
    """A site's CURVE secret key (Z85) as the X25519 key it is (CURVE is Curve25519)."""
    return X25519PrivateKey.from_private_bytes(z85.decode(secret_z85))


def curve_public_raw(public: bytes) -> bytes:
    """A CURVE public key (raw or Z85, e.g. from a certificate) as 32 raw X25519 bytes."""
    raw = curve_raw(public) if len(public) == 40 else bytes(public)
    if len(raw) != 32:
        raise ValueError(f"an X25519 public key has 32 bytes, got {len(raw)}")
    return raw


def check_x25519_public(public: bytes) -> None:
    """Raise ValueError unless ``public`` is a 32-byte X25519 public key a pair can mask with.

    The all-zero key, the other points of small order and their non-canonical encodings give
    the all-zero shared secret with every key: X25519 refuses the exchange (a peer announcing
    one would stop every honest site from masking) and nothing secret would come of it. An
    exchange with a fixed probe key tells: its scalar is a multiple of 8 below the large prime
    orders, so the result is zero exactly for those points."""
    if len(public) != 32:
        raise ValueError(f"an X25519 public key has 32 bytes, got {len(public)}")
    try:
        _PROBE_KEY.exchange(X25519PublicKey.from_public_bytes(bytes(public)))
    except ValueError:
        raise ValueError("the X25519 public key is a point of small order") from None


_PROBE_KEY = X25519PrivateKey.from_private_bytes(hashlib.sha256(b"crossdc-x25519-probe").digest())


@dataclass(frozen=True, kw_only=True)
class Peer:
    """A site's keys as the coordinator relays them for masking."""

    session_public: bytes
    """Raw 32-byte X25519 public key of the site's current session key."""
    certificate: bytes | None = None
    """The site's certificate (PEM), signed by the federation CA: it binds the site's CURVE key
    (an X25519 key) to its site id. A site with a kit verifies it against its own kit's CAs
    before masking with the peer (:class:`comm.security.secagg.PeerTrust`); None without
    certificates (an insecure loopback federation)."""


def _ordered(site_ids: Collection[str]) -> list[str]:
    return sorted(site_ids)


def _pair_key(
    *,
    session_id: str,
    round_id: int,
    attempt: int,
    members: list[str],
    lo: str,
    hi: str,
    peers: Mapping[str, Peer],
    shared: bytes,
) -> bytes:
    info = json.dumps(
        {
            "session": session_id,
            "round": round_id,
            "attempt": attempt,
            "members": members,
            "pair": [lo, hi],
            "keys": [peers[lo].session_public.hex(), peers[hi].session_public.hex()],
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=info).derive(shared)


def mask_stream(
    pair_key: bytes, name: str, size: int, config: SecAggConfig
) -> npt.NDArray[np.unsignedinteger[Any]]:
    """The pair's mask for one tensor: ``size`` uniform words of a ChaCha20 keystream."""
    tensor_key = hmac.new(pair_key, b"tensor\0" + name.encode(), hashlib.sha256).digest()
    # The key is unique per (pair, session, round, attempt, members, tensor): a zero nonce is safe.
    enc = Cipher(algorithms.ChaCha20(tensor_key, bytes(16)), mode=None).encryptor()
    stream = enc.update(bytes(size * config.dtype.itemsize))
    return np.frombuffer(stream, dtype=config.dtype).copy()
