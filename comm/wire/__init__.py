"""The wire: every message a site and the coordinator exchange, and how it becomes frames.

This package owns the message schema (``schema``: message types, ``PROTOCOL_VERSION``, error
codes), the frame codec (``frames``: messages to ZeroMQ frames and back, never pickle, with replay
rejection), chunking of messages too large for one frame (``chunking``) and named tensors as
payloads (``tensors``, with the state hash both roles compare).

Import rule: it may import ``comm.codecs`` (tensor payloads are encoded tensors) and nothing else
from ``comm``; never the transport, security or ops packages, nor ``coordinator``, ``site_agent``
or ``crossdc``.
"""
