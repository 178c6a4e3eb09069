"""The site agent's process exit codes, all in one place.

A supervisor reads them to decide on a restart: the deploy units list the codes they must not
restart (:data:`EXIT_CANNOT_START`, the command line's bad-config code, :data:`EXIT_FATAL` and
:data:`EXIT_AUTH_REFUSED`).
"""

from __future__ import annotations

EXIT_OK = 0
"""The federation finished, or the site left it when asked (a signal, the script's loop ended)."""

EXIT_CRASHED = 1
"""Library mode: the agent's thread raised (Python's own status for an uncaught exception)."""

EXIT_CANNOT_START = 2
"""The site cannot start as configured: its job (pipelined: its cut too) or its key kit is
refused. The command line's bad-config status (``crossdc.cli_common.EXIT_BAD_CONFIG``)."""

EXIT_FATAL = 3
"""Not worth a restart: the coordinator refused this site's model (``model_mismatch``), or the
job's loss stayed non-finite."""

EXIT_AUTH_REFUSED = 4
"""The coordinator refuses this site's credentials for good (revoked or expired certificate, or
refusals that persisted, see ``site_agent.authwatch``): a supervisor must not restart it."""

EXIT_FAULT_DRILL = 17
"""Fault drill (``site.fault_exit_before_send_round``): the process died on purpose right before
sending an update, without cleaning up, as a crashed site would."""
