"""Helpers for the federation key tests."""

from __future__ import annotations

import pytest

from comm.security.common import AuthError

DAY = 86400.0


def auth_reason(exc: pytest.ExceptionInfo[AuthError]) -> str:
    """The reason an :class:`AuthError` gives (what the coordinator counts and logs)."""
    return exc.value.reason
