"""Connect to Ray: a running cluster (``--address``, RAY_ADDRESS, or inside ``ray job submit``) or a new local one.

A new local Ray gets a configurable temp dir and bounded logs: the seed's /tmp filled with /tmp/ray logs and took a
machine down.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterInfo:
    address: str
    started_here: bool
    num_gpus: int
    num_cpus: int


def connect(
    address: str | None = None,
    *,
    num_gpus: int | None = None,
    num_cpus: int | None = None,
    temp_dir: str | None = None,
    log_max_mb: int = 100,
    log_backups: int = 2,
) -> ClusterInfo:
    """Attach to a running Ray cluster or start a local one; returns what the cluster offers.

    ``num_gpus`` declares GPUs for a *new local* Ray only (CPU machines declare fake GPUs this way so the placement
    code is the same); it is an error against an existing cluster, whose resources are its own.
    """
    import ray

    if ray.is_initialized():
        return _info(started_here=False)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        if num_gpus is not None:
            raise ConfigError("num_gpus", f"cannot declare GPUs when joining the running cluster at {address}.",
                              "Drop --num_gpus; the cluster's own GPUs are used.")
        ray.init(address=address, log_to_driver=True)
        return _info(started_here=False)
    # Bounded log files: Ray reads these when its processes start, so they are set before ray.init.
    os.environ.setdefault("RAY_ROTATION_MAX_BYTES", str(log_max_mb * 1024 * 1024))
    os.environ.setdefault("RAY_ROTATION_BACKUP_COUNT", str(log_backups))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if temp_dir is not None:
        temp_dir = os.path.abspath(temp_dir)
        os.makedirs(temp_dir, exist_ok=True)
    # address="local": always a new cluster of our own. Without it Ray joins any cluster already running on this
    # machine (found through /tmp/ray), someone else's included.
    ray.init(address="local", num_gpus=num_gpus, num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir,
             log_to_driver=True, logging_level=logging.WARNING)
    return _info(started_here=True)


def _info(started_here: bool) -> ClusterInfo:
    import ray

    resources = ray.cluster_resources()
    address = ray.get_runtime_context().gcs_address
    return ClusterInfo(address=address, started_here=started_here, num_gpus=int(resources.get("GPU", 0)),
                       num_cpus=int(resources.get("CPU", 0)))


def shutdown(info: ClusterInfo) -> None:
    """Stop Ray if this process started it; leave a shared cluster alone (just disconnect)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
