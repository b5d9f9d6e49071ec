"""Nothing leaves loopback: the checks the multi-node tests make (support/cluster.py).

`LoopbackAudit` samples the TCP sockets of this process and its descendants (the cluster's nodes,
their actors, the run) from /proc and records any whose end lies outside 127.0.0.0/8, naming the
process; `ray_logs_mention` searches Ray's logs for the machine's own non-loopback addresses
(`own_addresses`). Sampling misses a connection that opens and closes between two samples: for
every `connect` of a run, trace it (`strace -f --seccomp-bpf -e trace=connect`).
"""

from __future__ import annotations

import ipaddress
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path


def _hex_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host byte order)."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ipaddress.IPv4Address(words)
    v6 = ipaddress.IPv6Address(words)
    return v6.ipv4_mapped or v6


def _tree(root_pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root_pid}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _socket_inodes(pids: set[int]) -> dict[int, int]:
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[int(link[8:-1])] = pid
        except OSError:
            continue
    return inodes


def foreign_sockets(root_pid: int) -> list[str]:
    """TCP sockets of `root_pid` and its descendants with an end outside loopback (a listener on
    the wildcard address is not one: nothing connects through it unless something dials the
    machine's own address, which then shows here as a connection)."""
    inodes = _socket_inodes(_tree(root_pid))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, remote, inode = cols[1], cols[2], int(cols[9])
            if inode not in inodes:
                continue
            for end in (local, remote):
                addr = _hex_address(end.split(":")[0])
                if not (addr.is_loopback or addr.is_unspecified):
                    pid = inodes[inode]
                    try:
                        who = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
                    except OSError:
                        who = "?"
                    ends = f"{_hex_address(local.split(':')[0])} -> {_hex_address(remote.split(':')[0])}"
                    found.append(f"pid {pid} ({who}): {ends} (state {cols[3]})")
                    break
    return found


def own_addresses() -> list[str]:
    """This machine's IPv4 addresses outside loopback (from the kernel's routing trie)."""
    lines = Path("/proc/net/fib_trie").read_text().splitlines()
    found = {lines[i - 1].split()[-1] for i, line in enumerate(lines) if "/32 host LOCAL" in line and i > 0}
    return sorted(a for a in found if not ipaddress.IPv4Address(a).is_loopback)


def ray_logs_mention(root: Path, addresses: list[str]) -> list[str]:
    """Lines of Ray's logs under `root` that name one of `addresses`."""
    hits = []
    for log in root.glob("session_*/logs/*"):
        if log.is_file():
            text = log.read_text(errors="replace")
            hits += [f"{log.name}: {ln.strip()[:200]}" for ln in text.splitlines() if any(a in ln for a in addresses)]
    return hits


@dataclass
class LoopbackAudit:
    """Samples `foreign_sockets` every `every_s` seconds until stopped (a watcher, not part of the run)."""

    root_pid: int = field(default_factory=os.getpid)
    every_s: float = 0.5
    found: set[str] = field(default_factory=set)
    samples: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loopback-audit", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.found.update(foreign_sockets(self.root_pid))
            self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
