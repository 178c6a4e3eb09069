"""Kernel-level WAN shaping: two network namespaces joined by a veth pair shaped with ``tc`` HTB.

This module owns the real-rate-limit alternative to the userspace proxy in ``crossdc.lab.wanem``: the
kernel enforces the rate on every packet, so goodput, TCP's congestion control and socket buffers
behave as they do across a real bottleneck. :class:`NetnsPair` creates namespaces ``a`` and ``b``,
a veth pair with one end (and one address) in each, an HTB class on each end's egress (``a_to_b``
shapes what ``a`` sends, ``b_to_a`` what ``b`` sends), and deletes all of it on :meth:`close`,
also when setup failed half way. Names carry a random token, so parallel runs never collide.

Code runs inside a namespace in one of two ways: a command through ``ip netns exec``
(:meth:`NetnsPair.run`, :meth:`NetnsPair.popen`), or a Python callable in a fresh thread that first
joins the namespace with ``setns(2)`` (:func:`submit_in_netns`, :meth:`NetnsPair.call`). Sockets
keep the namespace they were created in, so a callable may create a socket and hand it back to
the calling thread. Everything here needs root; :func:`netns_available` says whether it can work.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar

log = logging.getLogger(__name__)

Side = Literal["a", "b"]
SIDES: tuple[Side, Side] = ("a", "b")

_P = ParamSpec("_P")
_T = TypeVar("_T")

_CLONE_NEWNET = 0x40000000
_NETNS_DIRS = ("/run/netns", "/var/run/netns")
_COMMAND_TIMEOUT_S = 30.0


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message holds the command and its stderr."""


@dataclass(frozen=True, kw_only=True)
class HtbShape:
    """One direction's HTB class: what one namespace may send to the other."""

    rate_bps: float
    """Guaranteed rate in bits per second."""

    ceil_bps: float | None = None
    """Most the class may reach by borrowing, in bits per second; ``None`` means ``rate_bps``.
    With a single class there is nobody to borrow from, so the rate is the limit."""

    burst_bytes: int | None = None
    """Bytes that may leave at ceil-free speed after idle time; ``None``: about 4 ms of
    ``rate_bps`` (at least 16 KiB), enough for the kernel timer to keep up with the rate."""

    cburst_bytes: int | None = None
    """Bytes that may leave at line speed after idle time; ``None``: same as ``burst_bytes``."""

    def __post_init__(self) -> None:
        if not (self.rate_bps > 0 and self.rate_bps < 2**64):
            raise ValueError(f"rate_bps must be > 0; got {self.rate_bps!r}")
        if self.ceil_bps is not None and not (self.rate_bps <= self.ceil_bps < 2**64):
            raise ValueError(f"ceil_bps must be >= rate_bps or None; got {self.ceil_bps!r}")
        for name in ("burst_bytes", "cburst_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None; got {value!r}")

    @property
    def effective_ceil_bps(self) -> float:
        return self.rate_bps if self.ceil_bps is None else self.ceil_bps

    @property
    def effective_burst_bytes(self) -> int:
        if self.burst_bytes is not None:
            return self.burst_bytes
        return max(16 * 1024, int(self.rate_bps / 8 * 0.004))

    @property
    def effective_cburst_bytes(self) -> int:
        return self.effective_burst_bytes if self.cburst_bytes is None else self.cburst_bytes

    def tc_class_args(self) -> list[str]:
        """The ``tc class ... htb`` parameters for this shape."""
        # quantum only matters between sibling classes; setting it keeps tc from warning that
        # rate / r2q is out of range.
        quantum = max(1514, min(200_000, int(self.rate_bps / 8 / 10)))
        return [
            "rate",
            f"{int(self.rate_bps)}bit",
            "ceil",
            f"{int(self.effective_ceil_bps)}bit",
            "burst",
            str(self.effective_burst_bytes),
            "cburst",
            str(self.effective_cburst_bytes),
            "quantum",
            str(quantum),
        ]


def _run(argv: Sequence[str], *, timeout_s: float = _COMMAND_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def netns_path(name: str) -> str:
    """The bind-mounted namespace file ``ip netns add NAME`` created."""
    for directory in _NETNS_DIRS:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise NetnsError(f"network namespace {name!r} not found in {' or '.join(_NETNS_DIRS)}")


def _setns_current_thread(path: str) -> None:
    """Move the calling OS thread (only it) into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def submit_in_netns(
    name: str, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
) -> Future[_T]:
    """Run ``fn(*args, **kwargs)`` in a new thread inside network namespace ``name``.

    The thread joins the namespace before calling ``fn`` and ends with it; threads ``fn``
    starts (e.g. a ZeroMQ context's I/O threads) inherit the namespace. Returns a future.
    """
    path = netns_path(name)
    future: Future[_T] = Future()

    def body() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            _setns_current_thread(path)
            result = fn(*args, **kwargs)
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=body, name=f"netns-{name}", daemon=True).start()
    return future


def run_in_netns(name: str, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run ``fn`` inside network namespace ``name`` (see :func:`submit_in_netns`) and wait."""
    return submit_in_netns(name, fn, *args, **kwargs).result()


def netns_command(name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` prefixed so that it runs inside network namespace ``name``."""
    return ["ip", "netns", "exec", name, *argv]


class NetnsPair:
    """Namespaces ``a`` and ``b`` joined by a veth pair, each end shaped by an HTB class.

    ``subnet`` (a /30 or larger) gives ``a`` its first host address and ``b`` its second.
    Lifecycle: :meth:`start` creates everything, :meth:`close` deletes it; or a context manager.
    """

    def __init__(
        self,
        *,
        a_to_b: HtbShape | None = None,
        b_to_a: HtbShape | None = None,
        subnet: str = "10.199.0.0/30",
        name_prefix: str = "crossdc",
    ) -> None:
        network = ipaddress.ip_network(subnet)
        if network.num_addresses < 4 and network.version == 4:
            raise ValueError(f"subnet must hold two host addresses; got {subnet!r}")
        hosts = network.hosts()
        self._addrs: dict[Side, str] = {"a": str(next(hosts)), "b": str(next(hosts))}
        self._prefixlen = network.prefixlen
        self._shapes: dict[Side, HtbShape | None] = {"a": a_to_b, "b": b_to_a}
        token = secrets.token_hex(4)
        self._ns: dict[Side, str] = {s: f"{name_prefix}-{token}-{s}" for s in SIDES}
        # Interface names are limited to 15 bytes.
        self._dev: dict[Side, str] = {s: f"cx{token}{s}" for s in SIDES}
        self._created: list[str] = []
        self._htb_installed: set[Side] = set()
        self._started = False
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Create both namespaces, the veth pair, the addresses and the shaping."""
        if self._started or self._closed:
            raise RuntimeError("start() called twice or after close()")
        self._started = True
        try:
            for side in SIDES:
                _run(["ip", "netns", "add", self._ns[side]])
                self._created.append(self._ns[side])
            # Both ends are born inside their namespaces: nothing is left behind in the host's.
            end_a = [self._dev["a"], "netns", self._ns["a"]]
            end_b = [self._dev["b"], "netns", self._ns["b"]]
            _run(["ip", "link", "add", *end_a, "type", "veth", "peer", "name", *end_b])
            for side in SIDES:
                ns, dev = self._ns[side], self._dev[side]
                addr = f"{self._addrs[side]}/{self._prefixlen}"
                _run(["ip", "-n", ns, "addr", "add", addr, "dev", dev])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                self._apply_shape(side, self._shapes[side])
        except BaseException:
            self.close()
            raise
        log.info(
            "[netns a=%s b=%s] %s <-> %s shaped a_to_b=%s b_to_a=%s",
            self._ns["a"],
            self._ns["b"],
            self._addrs["a"],
            self._addrs["b"],
            self._shapes["a"],
            self._shapes["b"],
        )

    def close(self) -> None:
        """Delete what :meth:`start` created (deleting a namespace deletes its veth end).
        Idempotent; errors are logged, not raised, so cleanup always runs to the end."""
        if self._closed:
            return
        self._closed = True
        while self._created:
            name = self._created.pop()
            try:
                _run(["ip", "netns", "del", name])
            except NetnsError as exc:
                log.warning("[netns %s] cleanup failed: %s", name, exc)

    def __enter__(self) -> NetnsPair:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- names ----------------------------------------------------------------------------

    def namespace(self, side: Side) -> str:
        return self._ns[side]

    def address(self, side: Side) -> str:
        """The IP address of ``side``'s veth end."""
        return self._addrs[side]

    def device(self, side: Side) -> str:
        return self._dev[side]

    @property
    def ns_a(self) -> str:
        return self._ns["a"]

    @property
    def ns_b(self) -> str:
        return self._ns["b"]

    @property
    def addr_a(self) -> str:
        return self._addrs["a"]

    @property
    def addr_b(self) -> str:
        return self._addrs["b"]

    # -- shaping --------------------------------------------------------------------------

    def shape(self, side: Side) -> HtbShape | None:
        """The shaping of what ``side`` sends."""
        return self._shapes[side]

    def set_shape(self, side: Side, shape: HtbShape | None) -> None:
        """Change (or with ``None`` remove) the shaping of what ``side`` sends, live."""
        self._apply_shape(side, shape)
        self._shapes[side] = shape

    def _apply_shape(self, side: Side, shape: HtbShape | None) -> None:
        ns, dev = self._ns[side], self._dev[side]
        if shape is None:
            if side in self._htb_installed:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])
                self._htb_installed.discard(side)
            return
        # One HTB class 1:1 that all traffic falls into. An HTB root cannot be "replaced" by
        # another HTB root, so a live change only replaces the class.
        if side not in self._htb_installed:
            qdisc = ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"]
            _run(["tc", "-n", ns, *qdisc])
            self._htb_installed.add(side)
        klass = ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb"]
        _run(["tc", "-n", ns, *klass, *shape.tc_class_args()])

    def tc_stats(self, side: Side) -> str:
        """``tc -s class show`` of ``side``'s veth end (bytes sent, drops, overlimits)."""
        return _run(["tc", "-n", self._ns[side], "-s", "class", "show", "dev", self._dev[side]])

    # -- running code inside --------------------------------------------------------------

    def command(self, side: Side, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside ``side``'s namespace."""
        return netns_command(self._ns[side], argv)

    def run(
        self, side: Side, argv: Sequence[str], *, timeout_s: float | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside ``side``'s namespace and wait; output is captured as text."""
        return subprocess.run(
            self.command(side, argv), capture_output=True, text=True, timeout=timeout_s, check=check
        )

    def popen(self, side: Side, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start a command inside ``side``'s namespace; the caller owns (and must reap) it."""
        return subprocess.Popen(self.command(side, argv), **kwargs)

    def submit(
        self, side: Side, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs
    ) -> Future[_T]:
        """Run a callable in a new thread inside ``side``'s namespace; see :func:`submit_in_netns`."""
        return submit_in_netns(self._ns[side], fn, *args, **kwargs)

    def call(self, side: Side, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run a callable inside ``side``'s namespace and return its result."""
        return run_in_netns(self._ns[side], fn, *args, **kwargs)


def netns_available() -> tuple[bool, str]:
    """Whether :class:`NetnsPair` works here, and why not if it does not.

    Checks root, ``ip`` and ``tc`` on ``PATH``, then builds a trial pair with HTB on both ends
    and joins one namespace from a thread.
    """
    if os.geteuid() != 0:
        return False, "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool!r} (iproute2) not found on PATH"
    trial = HtbShape(rate_bps=1e6)
    try:
        with NetnsPair(a_to_b=trial, b_to_a=trial, name_prefix="crossdc-probe") as pair:
            pair.call("a", lambda: None)
    except (NetnsError, OSError) as exc:
        return False, f"a trial namespace pair failed: {exc}"
    return True, "network namespaces, veth and tc HTB work"
