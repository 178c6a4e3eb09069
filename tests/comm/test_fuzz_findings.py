"""What ``crossdc bench fuzz`` found in the decoders, one regression test each: every input here
made a decoder raise something other than its documented refusal (``WireError``, ``ValueError``,
``AuthError``); each must now be refused with it."""

from __future__ import annotations

import base64

import msgpack
import numpy as np
import pytest
import zmq
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from comm.codecs.base import EncodedTensor
from comm.codecs.registry import get_codec
from comm.security.certs import (
    Certificate,
    make_ca_certificate,
    make_site_certificate,
    parse_ca_certificate,
)
from comm.security.common import AuthError, curve_raw
from comm.security.crl import Revocation, RevocationList, parse_revocations
from comm.security.masking import curve_public_raw
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.schema import ErrorCode, Leave, Update
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


# ---- certificates and revocation lists ------------------------------------------------------


def test_a_site_certificate_with_an_unknown_key_algorithm_is_refused(site_der: bytes) -> None:
    """Was cryptography's UnsupportedAlgorithm, raised by the subject key's lookup."""
    der = _replace_nth(site_der, X25519_OID, UNKNOWN_OID, 1)
    with pytest.raises(AuthError) as exc:
        Certificate.from_pem(_pem(der))
    assert exc.value.reason == "bad_signature"


def test_a_ca_certificate_with_an_unknown_key_algorithm_is_refused(ca_der: bytes) -> None:
    """Was UnsupportedAlgorithm; the second Ed25519 identifier is the subject key's (the
    first and third name the signature algorithm)."""
    der = _replace_nth(ca_der, ED25519_OID, UNKNOWN_OID, 2)
    with pytest.raises(AuthError) as exc:
        parse_ca_certificate(_pem(der))
    assert exc.value.reason == "bad_signature"


@pytest.mark.parametrize("which", ["site", "ca"])
def test_a_certificate_of_an_unknown_x509_version_is_refused(
    which: str, site_der: bytes, ca_der: bytes
) -> None:
    """Was cryptography's InvalidVersion, which is no ValueError."""
    der = _replace_nth(site_der if which == "site" else ca_der, V3, bytes.fromhex("a003020106"), 1)
    with pytest.raises(AuthError):
        (Certificate.from_pem if which == "site" else parse_ca_certificate)(_pem(der))


def test_a_revocation_list_of_an_unknown_version_is_refused(ca_key: Ed25519PrivateKey) -> None:
    """Was InvalidVersion, past the loader's except clause: a coordinator re-reading such a
    crl.pem would have failed instead of keeping the list it had."""
    serial = "2b".zfill(32)
    revs = RevocationList(
        version=3, issued_at=NOW, entries=(Revocation(serial=serial, revoked_at=NOW),)
    )
    der = _der(revs.to_pem(ca_key, next_update=NOW + 60))
    assert parse_revocations(_pem(der, "X509 CRL"), ca_key.public_key()).serials == {serial}
    bad = _replace_nth(der, bytes.fromhex("020101"), bytes.fromhex("020111"), 1)  # v2 -> v18
    with pytest.raises(AuthError) as exc:
        parse_revocations(_pem(bad, "X509 CRL"), ca_key.public_key())
    assert exc.value.reason == "bad_signature"


def test_z85_digits_that_overflow_32_bits_are_no_curve_key() -> None:
    """Was struct.error from the Z85 decoder (a certificate's CURVE key extension, a masking
    peer's certified key): '%' is Z85's highest digit, five of them exceed 2^32."""
    for decode in (curve_raw, curve_public_raw):
        with pytest.raises(ValueError, match="not a Z85-encoded CURVE key"):
            decode(b"%" * 40)


# ---- codecs ---------------------------------------------------------------------------------


def test_a_topk_tensor_larger_than_its_indices_address_is_refused() -> None:
    """Was a MemoryError: a 16-byte payload whose shape claimed 2^35 elements made the decoder
    allocate them (128 GiB)."""
    enc = EncodedTensor(
        name="w",
        shape=(1 << 35,),
        codec="topk:0.1",
        meta={"k": 1, "values": "fp32"},
        buffers=(np.ones(1, np.float32), np.zeros(1, np.uint32)),
    )
    with pytest.raises(ValueError, match="indices address at most"):
        get_codec("topk:0.1").decode(enc)


def test_a_corrupt_zstd_position_bitmap_is_refused() -> None:
    """Was zstandard's ZstdError: chunktopk checked the bitmap frame's declared size but not
    that it decompresses."""
    codec = get_codec("chunktopk:chunk=64,k=4")
    x = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    enc = codec.encode("w", x)
    positions = np.zeros(128, np.uint8)
    positions[np.flatnonzero(codec.decode(enc))] = 1
    bitmap = np.packbits(positions).tobytes()
    frame = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(bitmap))
    frame[-5] ^= 0xFF  # the last byte of the block, before the checksum
    meta = {**enc.meta, "positions": "zbitmap", "rice": 0}
    buffers = (np.frombuffer(bytes(frame), np.uint8), *enc.buffers[1:])
    bad = EncodedTensor(name="w", shape=(128,), codec=enc.codec, meta=meta, buffers=buffers)
    with pytest.raises(ValueError, match="bad zstd frame for positions"):
        codec.decode(bad)


def test_fields_with_keys_of_mixed_types_are_malformed_not_a_type_error() -> None:
    # Found by `crossdc bench fuzz --seconds 600` (target "header"): the error message sorted
    # the received field names, and a bytes key among str keys made that sort raise TypeError.
    header = msgpack.unpackb(to_wire(Leave(site_id="eu", reason="x"), seq=1)[0], raw=False)
    header["f"] = {"site_id": "eu", b"reason": "x"}
    with pytest.raises(WireError) as err:
        from_wire([msgpack.packb(header, use_bin_type=True)])
    assert err.value.code == ErrorCode.MALFORMED and "fields" in err.value.detail
