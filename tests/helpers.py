"""What several test modules share (no test module imports another's privates)."""

from __future__ import annotations

import os

import psutil

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listeners_beyond_loopback(root: int | None = None) -> list[str]:
    """Every listening TCP socket of process `root` (default: this one) and all its descendants that another
    machine could reach (bound to an address other than loopback), as 'ADDRESS:PORT (command)'."""
    top = psutil.Process(root or os.getpid())
    found = []
    for proc in [top, *top.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="tcp")
            name = " ".join(proc.cmdline())[:100]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [f"{c.laddr.ip}:{c.laddr.port} ({name})" for c in conns
                  if c.status == psutil.CONN_LISTEN and c.laddr.ip not in LOOPBACK]
    return found
