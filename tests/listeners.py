"""Which TCP ports a set of processes listens on, read from ``/proc`` (Linux): ``/proc/net/tcp`` and
``tcp6`` give each listening socket's address and inode, ``/proc/PID/fd`` which process holds it."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str  # the process's comm (``gcs_server``, ``raylet``, ``ray::IDLE``, ``python``)
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # four 32-bit words, each little-endian
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _listening_inodes() -> dict[str, tuple[str, int]]:
    found: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN:
                found[fields[9]] = _address(fields[1])
    return found


def listeners(pids: set[int]) -> list[Listener]:
    """Every listening TCP socket held by one of ``pids``."""
    inodes = _listening_inodes()
    out = []
    for pid in sorted(pids):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                host, port = inodes[target[8:-1]]
                out.append(Listener(pid, name, host, port))
    return out
