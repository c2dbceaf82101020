"""Ports for the tests' servers."""

from __future__ import annotations

import itertools
import os
import socket

# The tests' servers take their ports from a block of each test process's own (pytest-xdist names them gw0, gw1,
# ...), below the kernel's ephemeral range (from 32768 on Linux): a port the kernel picked (bind to port 0) could be
# taken between its choice and the server binding it, by the other test process or by any outgoing connection.
FIRST_PORT, PORT_BLOCK, PORT_BLOCKS = 20000, 1000, 12
_ports_taken = itertools.count()


def free_port() -> int:
    """A port nothing listens on now, of this test process's block, each a different one until the block wraps."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    block_start = FIRST_PORT + int(worker) % PORT_BLOCKS * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        port = block_start + next(_ports_taken) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: another service's, or one of ours still closing
                continue
        return port
    raise RuntimeError(f"no free port from {block_start} to {block_start + PORT_BLOCK - 1}")
