"""What a site and the coordinator share: the wire, codecs, transport, security and operations.

``comm.codecs`` (tensor payload codecs, error feedback) is the bottom; ``comm.wire`` (message
schema, frame codec, chunking, tensor payloads) builds on it; ``comm.security`` (keys,
certificates, ZAP, secure aggregation) and ``comm.ops`` (config loading, /metrics and /status)
stand alone; ``comm.transport`` (ZeroMQ channels, chunked transfers, link estimates) uses the
wire and security. ``comm`` never imports ``coordinator``, ``site_agent`` or ``crossdc``;
tests/test_import_rules.py holds the rules.
"""
