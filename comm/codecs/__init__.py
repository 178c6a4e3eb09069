"""Tensor payload codecs: how a float32 tensor becomes bytes on the wire and back.

This package owns the codec seam and every codec. A codec turns one float32 tensor into an
:class:`~comm.codecs.base.EncodedTensor` (a small msgpack-able ``meta`` dict plus raw buffers that
travel as zero-copy frames) and back. The wire layer (``comm.wire``) never looks inside ``meta`` or
the buffers; it only carries them, naming the codec by ``codec_id`` and ``spec``.

Codecs, by spec string (see ``docs/compression.md`` for sizes and error bounds):

- ``fp32``: the float32 bytes (lossless).
- ``fp16``: IEEE half precision; values beyond +-65504 saturate.
- ``bf16``: bfloat16 bit patterns as uint16, round to nearest even.
- ``int8[:block=N]`` / ``int4[:block=N]`` / ``int2[:block=N]``: blockwise symmetric absmax
  quantization, one fp16 scale per block; int4 packs two values per byte, int2 (ternary) four.
- ``topk:F[,values=fp16]``: the ``round(F * numel)`` largest magnitudes with uint32 indices.
- any of the above followed by ``+zstd[:level=L]``: a lossless zstandard stage over each buffer.

Invariants every codec keeps: ``encode`` rejects NaN/Inf with ``NonFiniteError``; ``decode``
validates the buffers against the sizes the meta implies and rejects a non-finite result; encoded
buffers never alias the input and decoded arrays are fresh, writable and C-contiguous; the
elementwise and blockwise codecs can encode a flat tensor chunk by chunk with byte-identical
results (``chunk_multiple``, ``encode_chunks``, ``join_chunks``).

Modules: ``base`` (the encoded form, the protocol, finiteness), ``plumbing`` (shared array helpers
and the codec skeleton), ``floats``, ``quantize``, ``sparse``, ``entropy`` (the codec families),
``registry`` (spec strings and wire ids, chunked encoding), ``feedback`` (error feedback).

Importing any of it imports no torch: specs, wire ids, layouts and sizes need none, so a
coordinator's config or a frame parses without it. The functions that encode and decode import
torch where they use it (the first call pays for the import).

Import rule: this package is the bottom of ``comm``; it imports nothing else from ``comm`` (nor
from ``coordinator``, ``site_agent`` or ``crossdc``).
"""
