"""A codec family added the way a new one is: one class, registered by name and wire id, reading
its own spec parameters. Nothing else names it, yet specs, wire ids, the zstd stage and chunked
encoding take it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest

from comm.codecs.base import EncodedTensor, TensorLike, check_finite
from comm.codecs.plumbing import Layout, _bad_meta, _Codec, _meta_int
from comm.codecs.registry import (
    CODEC_IDS,
    SpecParams,
    codec_from_id,
    decode_tensor,
    encode_chunks,
    families,
    get_codec,
    join_chunks,
    register_codec,
    unregister_codec,
)
from tests.support.codecs import sample

pytestmark = pytest.mark.timeout(60)

_F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class ToyScaleCodec(_Codec):
    """float32 times a power of two: lossless, elementwise, its scale in ``meta``."""

    scale: int = 2
    name: ClassVar[str] = "toyscale"
    codec_id: ClassVar[int] = 15
    chunk_multiple: ClassVar[int] = 1

    @property
    def spec(self) -> str:
        return self.name if self.scale == 2 else f"{self.name}:scale={self.scale}"

    @classmethod
    def from_spec(cls, params: SpecParams) -> ToyScaleCodec:
        params.allow("scale")
        return cls(scale=params.integer("scale")) if "scale" in params.keywords else cls()

    def encode(self, name: str, x: TensorLike) -> EncodedTensor:
        check_finite(name, x)
        arr = np.asarray(x, dtype=np.float32)
        wire = (arr.reshape(-1) * np.float32(self.scale)).astype(np.float32)
        return EncodedTensor(
            name=name, shape=arr.shape, codec=self.spec, meta={"scale": self.scale}, buffers=(wire,)
        )

    def _layout(self, numel: int, meta: dict[str, Any] | None) -> Layout:
        if meta is not None and (set(meta) != {"scale"} or _meta_int(meta, "scale", self.name) < 1):
            _bad_meta(meta, self.name)
        return [(_F32, numel)]

    def _decode_arrays(
        self, enc: EncodedTensor, numel: int, arrays: list[npt.NDArray[Any]]
    ) -> npt.NDArray[np.float32]:
        return (arrays[0] / np.float32(enc.meta["scale"])).astype(np.float32)


@pytest.fixture
def toy_codec() -> Iterator[type[ToyScaleCodec]]:
    register_codec(ToyScaleCodec)
    try:
        yield ToyScaleCodec
    finally:
        unregister_codec("toyscale")


def test_a_registered_codec_parses_round_trips_and_takes_the_stage(
    toy_codec: type[ToyScaleCodec],
) -> None:
    x = sample(1000, seed=3)
    assert CODEC_IDS["toyscale"] == 15
    assert families()[-1] is toy_codec
    for spec, canonical in (
        ("toyscale", "toyscale"),
        ("toyscale:scale=4", "toyscale:scale=4"),
        ("toyscale:scale=4+zstd", "toyscale:scale=4+zstd"),
    ):
        codec = get_codec(spec)
        assert codec.spec == canonical
        enc = codec.encode("w", x)
        assert np.array_equal(decode_tensor(enc), x)  # by the spec the encoding names
        assert np.array_equal(codec_from_id(codec.codec_id).decode(enc), x)  # by its wire id
    assert get_codec("toyscale+zstd").codec_id == 15 | 0x10
    with pytest.raises(ValueError, match="toyscale: unknown parameter 'k'"):
        get_codec("toyscale:k=3")
    chunks = list(encode_chunks(get_codec("toyscale"), "w", x, 128))
    whole = join_chunks(get_codec("toyscale"), "w", x.shape, chunks)
    assert whole.buffers[0].tobytes() == get_codec("toyscale").encode("w", x).buffers[0].tobytes()


def test_an_unregistered_codec_is_unknown_again(toy_codec: type[ToyScaleCodec]) -> None:
    get_codec("toyscale")
    unregister_codec("toyscale")
    with pytest.raises(ValueError, match="unknown codec 'toyscale'"):
        get_codec("toyscale")
    with pytest.raises(ValueError, match="unknown codec id 15"):
        codec_from_id(15)
    assert "toyscale" not in CODEC_IDS


def test_a_family_name_or_wire_id_is_registered_once(toy_codec: type[ToyScaleCodec]) -> None:
    clash = type("Clash", (toy_codec,), {"name": "other", "codec_id": 4})
    with pytest.raises(ValueError, match="clashes with 'int8'"):
        register_codec(clash)
    wide = type("Wide", (toy_codec,), {"name": "wide", "codec_id": 0x10})
    with pytest.raises(ValueError, match="codec_id must be in"):
        register_codec(wide)
    assert "other" not in CODEC_IDS and "wide" not in CODEC_IDS


def test_chunktopk_declares_it_takes_no_stage() -> None:
    with pytest.raises(ValueError, match="chunktopk entropy-codes its own positions; drop"):
        get_codec("chunktopk+zstd")
    with pytest.raises(ValueError, match="unknown codec id"):
        codec_from_id(9 | 0x10)
