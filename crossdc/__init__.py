"""crossdc: train one model across several data centers.

The command line is ``crossdc`` (``crossdc.cli``). For a team that keeps its own training script,
``crossdc.Federation`` federates the script's loop (``site_agent.library``); it is imported on
first use, so the command line starts without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from site_agent.library import Federation

__all__ = ["Federation"]


def __getattr__(name: str) -> Any:
    if name == "Federation":
        from site_agent.library import Federation

        return Federation
    raise AttributeError(f"module 'crossdc' has no attribute {name!r}")
