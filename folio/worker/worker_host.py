"""`folio worker`: a host other than the head one starts its share of the model's ranks and waits.

The ranks join the head host's rendezvous (MASTER_ADDR:MASTER_PORT), prove they hold the model's rank
secret (FOLIO_RANK_SECRET, the head's), and receive the model, the cache size and every other setting
from rank 0, so the command names only where to meet.
"""

from __future__ import annotations

import logging
import os
import signal

from folio.config import ParallelConfig
from folio.distributed import rank_auth
from folio.worker.executor import start_ranks, stop_ranks

logger = logging.getLogger("folio")


def run_worker_host(parallel: ParallelConfig, device: str) -> int:
    """Run ranks [node_rank * per_node, ...) until they end; returns the worst exit code."""
    if parallel.node_rank == 0:
        raise ValueError("node rank 0 is the head host: start it with `folio serve|run|bench`, not `folio worker`")
    addr = parallel.master_addr or os.environ.get("MASTER_ADDR")
    port = parallel.master_port or (int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None)
    if addr is None or port is None:
        raise ValueError("a worker host needs the head's rendezvous: --master-addr and --master-port (or "
                         "MASTER_ADDR and MASTER_PORT)")  # fmt: skip
    secret = rank_auth.secret_from_environment()
    if secret is None:
        raise ValueError(f"a worker host needs the model's rank secret: set {rank_auth.SECRET_ENV} to the value the "
                         "head host was given (or logged when it drew one)")  # fmt: skip
    per_node = parallel.ranks_per_node
    first = parallel.node_rank * per_node
    processes, _ = start_ranks(None, first, per_node, parallel.world_size, addr, port, device, secret)
    logger.info("ranks %d-%d of %d started, joining %s:%d", first, first + per_node - 1, parallel.world_size, addr,
                port)  # fmt: skip

    def forward_signal(sig: int, frame: object) -> None:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward_signal)
    try:
        for process in processes:
            process.join()
    except KeyboardInterrupt:
        forward_signal(signal.SIGINT, None)
    finally:
        stop_ranks(processes)
        signal.signal(signal.SIGTERM, previous)
    return max((p.exitcode or 0 for p in processes), default=0) and 1
