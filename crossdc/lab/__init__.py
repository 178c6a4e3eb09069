"""The lab: WAN link emulation for the demo, the tests and the benchmarks; not part of a deployment.

``wanem`` is a userspace TCP proxy that makes a loopback hop behave like one WAN link (rate,
delay, jitter, scripted cuts), built from ``profiles`` (link specs), ``shaping`` (token bucket,
delay line, per-connection pipes) and the proxy thread (``proxy_io``, ``proxy_loop``). ``netns``
shapes a veth pair between two network namespaces with ``tc`` HTB, for checks against a real
bottleneck (needs root).

Import rule: the lab imports nothing from ``comm``, ``coordinator`` or ``site_agent``, and
nothing in ``comm``, ``coordinator`` or ``site_agent`` imports the lab.
"""
