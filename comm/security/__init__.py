"""Security: a federation's keys and certificates, who may connect, and the protocols built on
the sites' certified keys.

This package owns every key and signed document crossdc uses (docs/security.md says which module
holds what): the federation CA and the X.509 certificates it signs (``certs``), its revocation
list (``crl``), kits on disk and the keys a running role loads (``kits``), blob signatures
(``signing``), the coordinator's registry of certified keys and revocations (``registry``),
moving a federation to a new CA (``rollover``), the identity a CURVE connection carries
(``identity``) and the ZAP handler that decides who may connect (``zap``). Names, errors and
helpers they share are in ``common``.

Import rule: it imports nothing else from ``comm`` (the transport imports it, for CURVE keys and
peer identities, not the reverse), and never ``coordinator``, ``site_agent`` or ``crossdc``.
"""
