"""The one error a receiver raises on frames that are not a valid message."""

from __future__ import annotations

from comm.wire.schema import ErrorCode


class WireError(ValueError):
    """A frame sequence that is not a valid message; ``code`` says why."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(f"{code.name.lower()}: {detail}")
        self.code = code
        self.detail = detail
