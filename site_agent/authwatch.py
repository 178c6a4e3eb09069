"""When the coordinator's refusals of this site's credentials mean the site must stop.

The coordinator answers a message whose connection's certificate does not allow it with
``ErrorCode.UNAUTHENTICATED`` and the reason in words (``comm.security.certs.Certificate.verify``).
Two causes are definitive: the certificate is revoked, or it expired. Restarting cannot fix
either, so the site exits with ``site_agent.exits.EXIT_AUTH_REFUSED`` (a code its unit does not
restart). Any other refusal (the coordinator does not know the connection's identity yet right
after a reconnect, a certificate it has not loaded yet) can clear by itself; the site exits on
one only when refusals persist for ``grace_s`` with nothing accepted in between. Pure: the caller
passes the time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

DEFAULT_GRACE_S = 300.0
"""How long non-definitive refusals may last, with nothing accepted, before the site gives up."""

RefusalCause = Literal["revoked", "expired", "other"]
"""Why the coordinator refused this site's credentials: only the first two are final."""

# The words of comm.security.certs.Certificate.verify, as the coordinator forwards them.
_REVOKED = re.compile(r"\bis revoked\b")
_EXPIRED = re.compile(r"\bexpired at\b")


def refusal_cause(detail: str) -> RefusalCause:
    """Why the coordinator refused, from the detail of its UNAUTHENTICATED error."""
    if _REVOKED.search(detail):
        return "revoked"
    if _EXPIRED.search(detail):
        return "expired"
    return "other"


@dataclass
class AuthWatch:
    """Counts refusals since the last sign that the coordinator accepted this site."""

    grace_s: float = DEFAULT_GRACE_S
    refused_since: float | None = None
    """When the current run of refusals began (None: the last word was an acceptance)."""
    refusals: int = 0
    """Refusals in the current run."""

    def accepted(self) -> None:
        """The coordinator accepted something of ours (a welcome, a round, an echo)."""
        self.refused_since = None
        self.refusals = 0

    def refused(self, detail: str, now: float) -> str | None:
        """One UNAUTHENTICATED error at ``now``: the reason to exit, or None to carry on."""
        cause = refusal_cause(detail)
        if cause != "other":
            return f"certificate {cause}"
        if self.refused_since is None:
            self.refused_since = now
        self.refusals += 1
        if self.refusals > 1 and now - self.refused_since >= self.grace_s:
            return f"refused for {now - self.refused_since:.0f} s ({self.refusals} times)"
        return None
