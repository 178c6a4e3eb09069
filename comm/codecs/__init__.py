"""Tensor payload codecs: how a float32 tensor becomes bytes on the wire and back.

This package owns the codec seam and every codec. A codec turns one float32 tensor into an
:class:`~comm.codecs.base.EncodedTensor` (a small msgpack-able ``meta`` dict plus raw buffers that
travel as zero-copy frames) and back. The wire layer (``comm.wire``) never looks inside ``meta`` or
the buffers; it only carries them, naming the codec by ``codec_id`` and ``spec``.

Codec families, one module each, each registering itself with ``registry`` (its name, wire id,
spec parameters, and whether the ``+zstd`` stage may follow it; see ``docs/compression.md`` for
sizes and error bounds):

- ``floats``: ``fp32`` (lossless), ``fp16`` (values beyond +-65504 saturate), ``bf16`` (round
  to nearest even).
- ``quantize``: ``int8`` / ``int4`` / ``int3`` / ``int2`` ``[:block=N]``, blockwise symmetric
  absmax quantization with one fp16 scale per block.
- ``sparse``: ``topk:F[,values=fp16]``, the ``round(F * numel)`` largest magnitudes with uint32
  indices.
- ``chunktopk``: ``chunktopk[:chunk=C,k=K,bits=B]``, the top k of every chunk of C values at B
  bits a value, positions Rice-coded (it takes no ``+zstd``).
- ``entropy``: ``+zstd[:level=L]`` after any of the others, a lossless zstandard stage over each
  buffer.

``registry.families()`` lists what is registered; a new family is a new module.

Invariants every codec keeps: ``encode`` rejects NaN/Inf with ``NonFiniteError``; ``decode``
validates the buffers against the sizes the meta implies and rejects a non-finite result; encoded
buffers never alias the input and decoded arrays are fresh, writable and C-contiguous; the
elementwise and blockwise codecs can encode a flat tensor chunk by chunk with byte-identical
results (``chunk_multiple``, ``encode_chunks``, ``join_chunks``). Every codec also reads an
encoded tensor in place, without a float copy of it: ``decode_into`` decodes a range of its
elements into a given float32 array (bit for bit ``decode`` there; the dense codecs read only the
blocks covering the range), ``accumulate`` adds ``float32(weight) *`` a range into one in place,
and ``sum_squares`` gives Σ x² from the encoded values, refusing what ``decode`` refuses.

Other modules: ``base`` (the encoded form, the protocol, finiteness), ``plumbing`` (shared array
helpers and the codec skeleton), ``registry`` (the families by name and wire id, spec strings,
chunked encoding), ``feedback`` (error feedback), ``broadcast`` (the sparse broadcast's step).

Importing any of it imports no torch: specs, wire ids, layouts and sizes need none, so a
coordinator's config or a frame parses without it. The functions that encode and decode import
torch where they use it (the first call pays for the import).

Import rule: this package is the bottom of ``comm``; it imports nothing else from ``comm`` (nor
from ``coordinator``, ``site_agent`` or ``crossdc``).
"""
