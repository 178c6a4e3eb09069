"""Wire codec: a round trip per message type, the registry, and rejection of bad frames."""

from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.codecs.base import EncodedTensor
from comm.codecs.floats import Fp32Codec
from comm.wire import schema
from comm.wire.frames import WireError, from_wire, to_wire
from comm.wire.payload import MAX_INDEX_BYTES, PACK_BELOW
from comm.wire.schema import MESSAGE_CLASSES, PROTOCOL_VERSION, ErrorCode, MessageType

pytestmark = pytest.mark.timeout(120)


def _payload() -> tuple[EncodedTensor, ...]:
    codec = Fp32Codec()
    return (
        codec.encode("layers.0.w", np.arange(12, dtype=np.float32).reshape(3, 4)),
        codec.encode("layers.1.b", np.array([-1.5, 2.25], dtype=np.float32)),
    )


SAMPLES: dict[MessageType, object] = {
    MessageType.JOIN: schema.Join(
        site_id="eu",
        model_fingerprint="ab12",
        global_version=-1,
        state_hash="00",
        capabilities={"stages": 2},
    ),
    MessageType.WELCOME: schema.Welcome(
        site_id="eu", session_id="s1", global_version=3, heartbeat_interval_s=1.0, need_init=False
    ),
    MessageType.HEARTBEAT: schema.Heartbeat(site_id="eu", global_version=3, sent_at=12.5),
    MessageType.LEAVE: schema.Leave(site_id="eu", reason="maintenance"),
    MessageType.INIT_PARAMS: schema.InitParams(
        site_id="eu", model_fingerprint="ab12", payload=_payload()
    ),
    MessageType.ROUND_START: schema.RoundStart(
        round_id=7,
        global_version=6,
        fragment_base_version=5,
        fragment=1,
        num_fragments=2,
        num_inner_steps=100,
        overlap=True,
        codec="fp32",
        deadline_s=30.0,
        participants=("ap", "eu"),
        evaluate=True,
        reason="fits",
    ),
    MessageType.ROUND_CANCEL: schema.RoundCancel(round_ids=(7, 8), reason="aborted"),
    MessageType.CHUNK_ACK: schema.ChunkAck(transfer_id="ab12", next_index=3, credit_bytes=8 << 20),
    MessageType.UPDATE: schema.Update(
        site_id="eu",
        round_id=7,
        global_version=6,
        fragment=0,
        weight=4096.0,
        train_loss=2.5,
        compute_seconds=3.0,
        step_seconds=0.03,
        link_rtt_s=0.16,
        link_goodput_bps=2e7,
        payload=_payload(),
    ),
    MessageType.GLOBAL: schema.Global(
        round_id=7,
        base_version=6,
        global_version=7,
        fragment=0,
        merged=("eu",),
        is_full=False,
        state_hash="ff",
        signature=b"\x01" * 64,
        evaluate=False,
        payload=_payload(),
    ),
    MessageType.EVAL: schema.Eval(
        site_id="eu", global_version=7, val_loss=2.1, metrics={"accuracy": 0.5}
    ),
    MessageType.ERROR: schema.Error(code=int(ErrorCode.STALE_ROUND), detail="round 3 is not open"),
    MessageType.SHUTDOWN: schema.Shutdown(reason="done"),
    MessageType.SYNC_REQUEST: schema.SyncRequest(site_id="eu", global_version=2),
    MessageType.STEP_GRAD: schema.StepGrad(
        site_id="eu", step=3, weight=512.0, loss=2.5, payload=_payload()
    ),
    MessageType.STEP_MEAN: schema.StepMean(step=3, num_sites=2, payload=_payload()),
    MessageType.CHUNK: schema.Chunk(
        transfer_id="t1", index=0, num_chunks=1, offset=0, total_bytes=5, digest="d", data=b"hello"
    ),
    MessageType.SHARD_HELLO: schema.ShardHello(
        shard=1, shards=2, partition="ab", global_version=4, round_counter=6, sent_at=1.5
    ),
    MessageType.SHARD_STATE: schema.ShardState(global_version=4, round_counter=6, sent_at=1.5),
    MessageType.SHARD_OPEN: schema.ShardOpen(
        round_id=7,
        base_version=6,
        fragment=0,
        participants=("ap", "eu"),
        quorum=2,
        deadline_s=30.0,
        plan={"num_inner_steps": 100, "downlink": "int4", "uplink": {"eu": "int4"}},
    ),
    MessageType.SHARD_OPENED: schema.ShardOpened(shard=1, round_id=7),
    MessageType.SHARD_FOLDED: schema.ShardFolded(
        shard=1, round_id=7, site_id="eu", accepted=False, detail="norm 2e6 over 1e6"
    ),
    MessageType.SHARD_FREEZE: schema.ShardFreeze(round_id=7),
    MessageType.SHARD_FROZEN: schema.ShardFrozen(shard=1, round_id=7, folded=("ap", "eu")),
    MessageType.SHARD_CLOSE: schema.ShardClose(
        round_id=7, merged=("ap", "eu"), inner_steps=700, final=False
    ),
    MessageType.SHARD_PREPARED: schema.ShardPrepared(
        shard=1, round_id=7, global_version=7, digests={"layers.0.w": "ab" * 32}
    ),
    MessageType.SHARD_COMMIT: schema.ShardCommit(
        round_id=7, global_version=7, state_hash="cd" * 16, shard_hashes=("ef" * 16, "01" * 16)
    ),
    MessageType.SHARD_ABORT: schema.ShardAbort(round_ids=(7, 8), reason="a shard left"),
    MessageType.SHARD_INITIAL: schema.ShardInitial(
        shard=1, site_id="eu", shapes={"layers.0.w": [4, 2]}, digests={"layers.0.w": "ab" * 32}
    ),
    MessageType.SHARD_INITIAL_DONE: schema.ShardInitialDone(
        site_id="eu", state_hash="cd" * 16, shapes={"layers.0.w": [4, 2]}, reason=""
    ),
}


def _same(a: object, b: object) -> bool:
    assert dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "payload":
            assert len(x) == len(y)
            for ex, ey in zip(x, y, strict=True):
                assert (ex.name, tuple(ex.shape), ex.codec, ex.meta) == (
                    ey.name,
                    tuple(ey.shape),
                    ey.codec,
                    ey.meta,
                )
                for bx, by in zip(ex.buffers, ey.buffers, strict=True):
                    assert bytes(np.ascontiguousarray(bx)) == bytes(np.ascontiguousarray(by))
        elif isinstance(x, bytes | memoryview):
            assert bytes(x) == bytes(y)
        else:
            assert x == y, f.name
    return True


def test_every_message_type_has_a_sample_and_class() -> None:
    assert set(SAMPLES) == set(MessageType) == set(MESSAGE_CLASSES)


@pytest.mark.parametrize("mtype", list(MessageType), ids=lambda t: t.name)
def test_round_trip_per_type(mtype: MessageType) -> None:
    msg = SAMPLES[mtype]
    back = from_wire(to_wire(msg))  # type: ignore[arg-type]
    assert type(back) is type(msg)
    assert _same(msg, back)


def test_tensor_frames_are_not_copied() -> None:
    arr = np.arange(PACK_BELOW // 4, dtype=np.float32)  # 64 KiB: a frame of its own
    enc = EncodedTensor(name="a", shape=arr.shape, codec="fp32", buffers=(arr,))
    msg = schema.InitParams(site_id="x", model_fingerprint="f", payload=(enc,))
    frames = to_wire(msg)
    assert np.shares_memory(frames[1], arr)


def _many_small(n: int) -> tuple[EncodedTensor, ...]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        bufs = (
            rng.integers(0, 255, 1 + 7 * i, dtype=np.uint8),
            rng.random(3 + i).astype(np.float16),
        )
        out.append(EncodedTensor(name=f"t{i}", shape=(i,), codec="x", meta={"k": i}, buffers=bufs))
    return tuple(out)


def test_small_buffers_share_one_frame_and_a_large_index_travels_compressed() -> None:
    big = np.arange(PACK_BELOW // 4, dtype=np.float32)
    payload = (
        *_many_small(60),
        EncodedTensor(name="big", shape=big.shape, codec="fp32", buffers=(big,)),
    )
    msg = schema.InitParams(site_id="x", model_fingerprint="f", payload=payload)
    frames = to_wire(msg)
    assert len(frames) == 3  # header, the pack of 120 small buffers, the large one
    assert isinstance(msgpack.unpackb(frames[0])["p"], bytes)  # compressed
    assert np.shares_memory(frames[2], big)
    back = from_wire(frames)
    assert _same(msg, back)
    # A few tensors: a plain index, still one pack.
    few = schema.InitParams(site_id="x", model_fingerprint="f", payload=_many_small(3))
    frames = to_wire(few)
    assert len(frames) == 2 and isinstance(msgpack.unpackb(frames[0])["p"], list)
    assert _same(few, from_wire(frames))


def _with_index(index: object, frames: list[bytes]) -> list[bytes]:
    head = {"v": PROTOCOL_VERSION, "t": int(MessageType.INIT_PARAMS), "s": "", "q": 0}
    head["f"] = {"site_id": "x", "model_fingerprint": "f"}
    head["p"] = index
    return [msgpack.packb(head, use_bin_type=True), *frames]


@pytest.mark.parametrize(
    ("index", "frames", "match"),
    [
        (
            [{"n": "a", "s": [2], "c": "fp32", "m": {}, "b": [["float32", 8, 8]]}],
            [bytes(16)],
            "expected 0",
        ),
        (
            [{"n": "a", "s": [2], "c": "fp32", "m": {}, "b": [["float32", 8, 0]]}],
            [bytes(12)],
            "4 bytes left over",
        ),
        (
            [{"n": "a", "s": [2], "c": "fp32", "m": {}, "b": [["float32", 8, 0]]}],
            [bytes(4)],
            "expected 0 in 4",
        ),
        ([{"n": "a", "s": [2], "c": "fp32", "m": {}, "b": [["float32", 8, 0]]}], [], "no frames"),
        (
            [{"n": "a", "s": [2], "c": "fp32", "m": {}, "b": [["float32", 6, 0]]}],
            [bytes(6)],
            "buffer of 6",
        ),
        (b"not zstd", [], "compressed payload index"),
        (
            zstandard.ZstdCompressor().compress(bytes(MAX_INDEX_BYTES + 1)),
            [],
            "compressed payload index",
        ),
    ],
    ids=["offset", "left-over", "beyond", "no-pack", "partial-item", "garbage", "bomb"],
)
def test_a_bad_pack_or_compressed_index_is_malformed_naming_it(
    index: object, frames: list[bytes], match: str
) -> None:
    with pytest.raises(WireError, match=match) as err:
        from_wire(_with_index(index, frames))
    assert err.value.code == ErrorCode.MALFORMED


def _header(**over: object) -> bytes:
    head = {
        "v": PROTOCOL_VERSION,
        "t": int(MessageType.HEARTBEAT),
        "s": "session",
        "q": 1,
        "f": {"site_id": "eu", "global_version": 1, "sent_at": 1.0},
        "p": [],
    }
    head.update(over)
    return msgpack.packb(head)


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([], ErrorCode.MALFORMED),
        ([b"\xc1garbage"], ErrorCode.MALFORMED),
        ([msgpack.packb([1, 2, 3])], ErrorCode.MALFORMED),
        ([_header(v=PROTOCOL_VERSION + 1)], ErrorCode.WRONG_VERSION),
        ([_header(t=999)], ErrorCode.MALFORMED),
        ([_header(f={"site_id": "eu"})], ErrorCode.MALFORMED),
        (
            [_header(f={"site_id": "eu", "global_version": "3", "sent_at": 1.0})],
            ErrorCode.MALFORMED,
        ),
        (
            [_header(f={"site_id": "eu", "global_version": True, "sent_at": 1.0})],
            ErrorCode.MALFORMED,
        ),
        (
            [_header(f={"site_id": "eu", "global_version": 1, "sent_at": 1.0, "extra": 1})],
            ErrorCode.MALFORMED,
        ),
        ([_header(), b"stray frame"], ErrorCode.MALFORMED),
    ],
)
def test_bad_frames_are_rejected_with_a_code(frames: list[bytes], code: ErrorCode) -> None:
    with pytest.raises(WireError) as info:
        from_wire(frames)
    assert info.value.code is code


def _large_init() -> list[object]:
    big = np.arange(PACK_BELOW // 4, dtype=np.float32)
    encs = tuple(EncodedTensor(name=n, shape=big.shape, codec="fp32", buffers=(big,)) for n in "ab")
    return to_wire(schema.InitParams(site_id="x", model_fingerprint="f", payload=encs))


def test_payload_frame_size_must_match_header() -> None:
    frames = _large_init()
    frames[1] = bytes(frames[1])[:-4]  # type: ignore[arg-type]
    with pytest.raises(WireError, match="frame holds"):
        from_wire(frames)
    # Packed buffers: the pack cut short.
    frames = to_wire(SAMPLES[MessageType.UPDATE])  # type: ignore[arg-type]
    frames[1] = bytes(frames[1])[:-4]
    with pytest.raises(WireError, match="packed at"):
        from_wire(frames)


def test_missing_payload_frame_is_rejected() -> None:
    with pytest.raises(WireError, match="missing frames"):
        from_wire(_large_init()[:-1])


def test_oversize_is_rejected() -> None:
    frames = to_wire(SAMPLES[MessageType.UPDATE])  # type: ignore[arg-type]
    with pytest.raises(WireError) as info:
        from_wire(frames, max_bytes=16)
    assert info.value.code is ErrorCode.OVERSIZE


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_fuzz_random_frames_raise_only_wire_errors(frames: list[bytes]) -> None:
    with contextlib.suppress(WireError):
        from_wire(frames)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(list(MessageType)),
    st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.integers(min_value=-(2**63), max_value=2**64 - 1),
            st.text(max_size=8),
            st.none(),
            st.floats(),
        ),
        max_size=4,
    ),
)
def test_fuzz_wellformed_headers_with_wrong_fields(
    mtype: MessageType, fields: dict[str, object]
) -> None:
    head = msgpack.packb(
        {"v": PROTOCOL_VERSION, "t": int(mtype), "s": "", "q": 0, "f": fields, "p": []}
    )
    with contextlib.suppress(WireError):
        from_wire([head])
