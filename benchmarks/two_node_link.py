"""Two emulated "nodes" on one machine: two network namespaces joined by a rate-limited veth.

Used by ``benchmarks/two_nodes.py``; needs root and iproute2 (``ip``, ``tc``). The link
exists only inside namespaces this module creates: the veth pair is created directly in
them (it never appears in the machine's own namespace) and carries only the private
addresses ``10.213.0.1/24`` and ``10.213.0.2/24``. Both ends get a ``tc tbf`` qdisc, so each
direction is limited to the rate. Deleting a namespace deletes its end of the veth, which
deletes the pair; :class:`TwoNodeLink` does that on exit, on failure and on Ctrl-C, and
refuses to start when a namespace of its names already exists (a run that was killed with
SIGKILL leaves them behind: ``two_nodes.py --cleanup`` removes exactly those).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess

import attrs

#: Every name this module creates starts with this prefix, so stale ones can be told apart.
PREFIX = "dhx2n"
NAMESPACES = (f"{PREFIX}-a", f"{PREFIX}-b")
#: The veth end inside each namespace (interface names: at most 15 characters).
DEVICES = (f"{PREFIX}-a", f"{PREFIX}-b")
ADDRESSES = ("10.213.0.1", "10.213.0.2")
PREFIX_LEN = 24


class LinkError(Exception):
    """The emulated link cannot be set up (not root, no iproute2, names taken, ip failed)."""


@attrs.frozen
class Shaping:
    """The ``tc tbf`` parameters put on both ends of the veth."""

    rate: str = "200mbit"
    burst: str = "256kb"
    latency: str = "50ms"

    def describe(self) -> str:
        """``tbf rate 200mbit burst 256kb latency 50ms``."""
        return f"tbf rate {self.rate} burst {self.burst} latency {self.latency}"


def check_can_run() -> None:
    """Raise LinkError unless this process is root and ``ip`` and ``tc`` are on the PATH."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)")
    if os.geteuid() != 0:
        raise LinkError("network namespaces need root: run this script with sudo (or as root)")


def existing_namespaces() -> list[str]:
    """The namespaces of ours (:data:`NAMESPACES`) that exist now."""
    listed = _ip("netns", "list").split("\n")
    names = {line.split()[0] for line in listed if line.strip()}
    return [name for name in NAMESPACES if name in names]


def remove_namespaces(names=NAMESPACES) -> list[str]:
    """Delete those of ``names`` (ours, :data:`NAMESPACES`) that exist; their veth ends go
    with them. Returns the names deleted. Never touches a namespace not named there."""
    removed = []
    for name in existing_namespaces():
        if name in names:
            _ip("netns", "del", name)
            removed.append(name)
    return removed


class TwoNodeLink:
    """A context manager: on entry the two namespaces, the veth between them with its
    addresses and the rate limit; on exit (normal, exception, Ctrl-C or SIGTERM) they are
    deleted. ``node(i)`` gives what a process of node i needs."""

    def __init__(self, shaping: Shaping):
        self.shaping = shaping
        self._created: list[str] = []  # only what this object made is removed
        self._old_handlers: dict = {}

    def __enter__(self) -> "TwoNodeLink":
        check_can_run()
        taken = existing_namespaces()
        if taken:
            raise LinkError(f"network namespace(s) {', '.join(taken)} already exist: another run of this "
                            "benchmark is going on, or one was killed; if none is running, remove them "
                            "with `benchmarks/two_nodes.py --cleanup`")
        # SIGTERM (kill, a CI timeout) must unwind through __exit__ like Ctrl-C does, and so
        # must SIGINT where a shell started us in the background with SIGINT ignored.
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[signum] = signal.signal(signum, _raise_interrupt)
        try:
            self._create()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _create(self) -> None:
        for name in NAMESPACES:
            _ip("netns", "add", name)
            self._created.append(name)
        # Created straight inside the namespaces: the pair never exists in the machine's own.
        _ip("link", "add", DEVICES[0], "netns", NAMESPACES[0], "type", "veth",
            "peer", "name", DEVICES[1], "netns", NAMESPACES[1])
        for name, device, address in zip(NAMESPACES, DEVICES, ADDRESSES, strict=True):
            _ip("-n", name, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", device)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", device, "up")
            _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", device, "root", "tbf",
                 "rate", self.shaping.rate, "burst", self.shaping.burst, "latency", self.shaping.latency)

    def _remove(self) -> None:
        if self._created:
            remove_namespaces(self._created)
            self._created = []
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers = {}

    def node(self, index: int) -> dict:
        """Node ``index``'s namespace, veth device and address."""
        return {"namespace": NAMESPACES[index], "device": DEVICES[index], "address": ADDRESSES[index]}

    def counters(self) -> dict[str, int]:
        """What the two ends' tbf qdiscs have counted since the link was made, summed: bytes
        and packets sent, packets dropped (the queue held more than ``latency`` of data: TCP
        backs off) and overlimits (packets the rate held back)."""
        totals = {"bytes": 0, "packets": 0, "dropped": 0, "overlimits": 0}
        for name, device in zip(NAMESPACES, DEVICES, strict=True):
            text = _run("ip", "netns", "exec", name, "tc", "-s", "qdisc", "show", "dev", device)
            found = QDISC_COUNTERS.search(text)
            if found is None:
                raise LinkError(f"`tc -s qdisc show dev {device}` in {name}: no counters in {text.strip()!r}")
            for key in totals:
                totals[key] += int(found.group(key))
        return totals

    def describe(self) -> str:
        """One line saying what the link is."""
        return (f"veth {DEVICES[0]} ({ADDRESSES[0]}/{PREFIX_LEN}, netns {NAMESPACES[0]}) <-> "
                f"{DEVICES[1]} ({ADDRESSES[1]}/{PREFIX_LEN}, netns {NAMESPACES[1]}), "
                f"{self.shaping.describe()} on both ends")


#: The counters line of ``tc -s qdisc show``: "Sent 123 bytes 4 pkt (dropped 0, overlimits 5 requeues 0)".
QDISC_COUNTERS = re.compile(r"Sent (?P<bytes>\d+) bytes (?P<packets>\d+) pkt \(dropped (?P<dropped>\d+), "
                            r"overlimits (?P<overlimits>\d+)")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _ip(*args: str) -> str:
    return _run("ip", *args)


def _run(*command: str) -> str:
    """Run an iproute2 command; LinkError with its message when it fails."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise LinkError(f"`{' '.join(command)}` failed: {result.stderr.strip() or result.returncode}")
    return result.stdout
