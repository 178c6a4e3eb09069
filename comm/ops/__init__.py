"""Operations: how a role reads its config and shows itself to operators.

``configio`` maps TOML tables (with ``CROSSDC_*`` environment overrides) onto frozen dataclass
configs, the one place where configuration is read; ``observe`` serves Prometheus ``/metrics``
and a JSON ``/status`` on one HTTP port.

Import rule: it imports nothing else from ``comm``, and never ``coordinator``, ``site_agent`` or
``crossdc``.
"""
