"""Hosts as Linux network namespaces on a bridge, for tests that cross a host boundary.

`Network(hosts=3)` makes a private "switch" namespace holding a bridge, and one
namespace per host with a veth link (``eth0``) onto that bridge. Host ``i``
has the address ``198.18.0.(i + 1)/24``, from the benchmarking range
198.18.0.0/15 (RFC 2544): the addresses exist only inside these namespaces,
which have no route anywhere else, so nothing here can reach (or be reached
from) a real network. Each namespace brings up its own ``lo``.

- ``network.popen(i, argv, ...)`` runs a process on host i (``ip netns exec``).
  The hosts share this machine's files, /tmp and /dev/shm: only their
  network is apart (which is why the tests check that no ipc:// address or
  shared memory crosses a host).
- ``network.limit(i, "100mbit")`` caps host i's link both ways (``tc tbf``).
- ``network.cut(i)`` / ``network.restore(i)`` take host i's switch port down
  and up again: its packets are dropped meanwhile, its connections stay.
- ``network.close()`` (also at the end of a ``with`` block) kills what it
  started and deletes every namespace, whatever happened. Names hold this
  process's pid and a counter (``ks<pid>n<k>h<i>``), so runs in other
  worktrees and pytest-xdist workers do not collide; namespaces left by a
  run whose process is gone are swept when a new `Network` is made.

`unavailable()` says why hosts cannot be made here (not root, no ``ip``, no
network namespaces), or None; tests skip with that reason.

Not thread-safe: one test thread drives a `Network`.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Optional

SUBNET = "198.18.0"  # /24 inside 198.18.0.0/15, the benchmarking range
_NAME = re.compile(r"^ks(\d+)n\d+(?:h\d+|sw)$")
_counter = itertools.count()
_checked: Optional[str] = None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> Optional[str]:
    """Why network namespaces cannot be made here, or None (checked once per process)."""
    global _checked
    if _checked is not None:
        return _checked or None
    reason = ""
    if sys.platform != "linux":
        reason = "network namespaces are Linux only"
    elif os.geteuid() != 0:
        reason = "making network namespaces needs root (CI runs these tests as root)"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "the ip and tc commands (iproute2) are not installed"
    else:
        probe = f"ks{os.getpid()}probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            reason = f"ip netns add failed: {made.stderr.strip()}"
        else:
            _ip("netns", "del", probe, check=False)
    _checked = reason
    return reason or None


def _sweep() -> None:
    """Deletes namespaces of earlier runs whose process is gone (a run killed mid-test)."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        match = _NAME.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            continue  # its run goes on
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _ip("netns", "del", name, check=False)


class Network:
    """Hosts as network namespaces on one bridge (see the module docstring).

    Args:
        hosts: how many hosts.
        rate: a link rate for every host (``tc`` syntax, "100mbit"), or None.
        queue: the longest a packet may wait in a link's token bucket (``tc tbf
            latency``); a longer queue drops fewer packets of bursts that meet.

    Not thread-safe.
    """

    def __init__(self, hosts: int, rate: Optional[str] = None, queue: str = "50ms"):
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        _sweep()
        self.prefix = f"ks{os.getpid()}n{next(_counter)}"
        self.switch = self.prefix + "sw"
        self.hosts = [f"{self.prefix}h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.processes: list[subprocess.Popen] = []
        self.queue = queue
        self._made: list[str] = []
        try:
            self._make(rate)
        except BaseException:
            self.close()
            raise

    def _make(self, rate: Optional[str]) -> None:
        for name in [self.switch, *self.hosts]:
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            # Made inside the switch namespace: the names never meet the root namespace's.
            port = f"p{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", host)  # fmt: skip
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
            if rate is not None:
                self.limit(i, rate)

    def limit(self, host: int, rate: str) -> None:
        """Caps host's link at rate both ways (a token bucket on each end of its veth)."""
        for namespace, device in ((self.hosts[host], "eth0"), (self.switch, f"p{host}")):
            subprocess.run(
                ["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device,
                 "root", "tbf", "rate", rate, "burst", "256kb", "latency", self.queue],
                check=True, capture_output=True, text=True, timeout=30,
            )  # fmt: skip

    def cut(self, host: int) -> None:
        """Takes host's switch port down: its packets are lost until `restore`."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def restore(self, host: int) -> None:
        """Brings host's switch port up again."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "up")

    def command(self, host: int, argv: list) -> list:
        """argv run on host (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.hosts[host], *argv]

    def popen(self, host: int, argv: list, **options) -> subprocess.Popen:
        """Starts argv on host (in a session of its own); stopped by `close` if still running."""
        options.setdefault("start_new_session", True)
        child = subprocess.Popen(self.command(host, argv), **options)
        self.processes.append(child)
        return child

    def close(self) -> None:
        """Kills what `popen` started (its whole session) and deletes every namespace."""
        for child in self.processes:
            if child.poll() is None:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for child in self.processes:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
