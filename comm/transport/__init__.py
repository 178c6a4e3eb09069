"""The transport: ZeroMQ channels with the WAN socket profile, chunked transfers, link estimates.

A ROUTER channel on the coordinator (``router``) and a DEALER channel on a site (``dealer``, with
:class:`~comm.transport.dealer.SiteLink` running it on an I/O thread) share one endpoint
(``sending`` and ``endpoint``): it owns sockets, framing, chunking, flow control and rejection of
bad input, and knows nothing about rounds or models. Messages whose frames exceed ``chunk_bytes``
travel as digested chunks under credit-based flow control (``credit``, ``sender``, ``receiver`` with
``receive_budget`` and ``chunk_checks``); messages to one peer arrive in the order they were sent
(heartbeats may overtake). Chunks and acknowledgements carry the sender's (session, sequence) like
every other message, so a resent chunk is a new send with a new sequence number. ``linkest``
measures each link (RTT, goodput, BDP) for the credit window and the scheduler; ``profile``
configures the sockets; ``stats`` counts. (The benchmarks' bare DEALER/ROUTER drivers of a
transfer live in ``crossdc.bench.transfer_drivers``.)

Import rule: it may import ``comm.wire`` (messages and frames) and ``comm.security`` (CURVE keys,
peer identities), nothing else from ``comm``, and never ``coordinator``, ``site_agent`` or
``crossdc``.
"""
