"""What ``crossdc bench fuzz`` found in the decoders, one regression test each: every input here
made a decoder raise something other than its documented refusal (``WireError``, ``ValueError``,
``AuthError``); each must now be refused with it."""

from __future__ import annotations

import base64

import msgpack
import numpy as np
import pytest
import zmq
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.codecs.registry import get_codec
from comm.security.certs import (
    make_ca_certificate,
    make_site_certificate,
)
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.schema import ErrorCode, Update
from comm.wire.tensors import encode_tensors

pytestmark = pytest.mark.timeout(30)

NOW = 1_700_000_000


def _der(pem: bytes) -> bytes:
    return base64.b64decode(b"".join(x for x in pem.splitlines() if not x.startswith(b"-----")))


def _pem(der: bytes, kind: str = "CERTIFICATE") -> bytes:
    body = base64.encodebytes(der)
    return f"-----BEGIN {kind}-----\n".encode() + body + f"-----END {kind}-----\n".encode()


@pytest.fixture(scope="module")
def ca_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def site_der(ca_key: Ed25519PrivateKey) -> bytes:
    public, _secret = zmq.curve_keypair()
    cert = make_site_certificate(
        ca_key, site_id="eu", curve_public=public, not_before=NOW, not_after=NOW + 60, serial="2a"
    )
    return cert.der


@pytest.fixture(scope="module")
def ca_der(ca_key: Ed25519PrivateKey) -> bytes:
    return _der(make_ca_certificate(ca_key, not_before=NOW, not_after=NOW + 60, serial="01"))


def _replace_nth(data: bytes, old: bytes, new: bytes, n: int) -> bytes:
    at = -1
    for _ in range(n):
        at = data.index(old, at + 1)
    return data[:at] + new + data[at + len(old) :]


X25519_OID = bytes.fromhex("06032b656e")  # 1.3.101.110
ED25519_OID = bytes.fromhex("06032b6570")  # 1.3.101.112
UNKNOWN_OID = bytes.fromhex("06032b654e")  # 1.3.101.78, no key algorithm
V3 = bytes.fromhex("a003020102")  # [0] EXPLICIT INTEGER 2: X.509 v3


# ---- frames ---------------------------------------------------------------------------------


def test_a_payload_buffer_spec_naming_no_dtype_string_is_malformed() -> None:
    """Was a TypeError: the dtype of a buffer spec was looked up in a set, and a list or map
    there is unhashable."""
    payload = encode_tensors({"w": np.ones(2, np.float32)}, get_codec("fp32"))
    update = Update(
        site_id="eu",
        round_id=1,
        global_version=0,
        fragment=0,
        weight=1.0,
        train_loss=1.0,
        compute_seconds=1.0,
        step_seconds=0.1,
        link_rtt_s=0.0,
        link_goodput_bps=0.0,
        payload=payload,
    )
    header, *data = to_wire(update)
    for dtype in (["float32"], {"float32": 1}):
        head = msgpack.unpackb(header, raw=False)
        head["p"][0]["b"][0][0] = dtype
        with pytest.raises(WireError) as exc:
            from_wire([msgpack.packb(head, use_bin_type=True), *data])
        assert exc.value.code is ErrorCode.MALFORMED
