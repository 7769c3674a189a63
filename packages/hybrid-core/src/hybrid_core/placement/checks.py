"""Small checks shared by the two spec constructors: whole numbers, the cluster's size."""

from __future__ import annotations

from ..errors import PlacementError


def cluster_size(cluster_gpus: int | None, gpus_per_node: int | None, num_nodes: int | None) -> int | None:
    """The cluster's GPU count from whichever of the three settings are given; checks they agree (errors name
    ``gpus_per_node`` as the placement's setting)."""
    if gpus_per_node is not None:
        require_int(gpus_per_node, "placement.gpus_per_node", minimum=1)
    if num_nodes is not None:
        require_int(num_nodes, "num_nodes", minimum=1)
        if gpus_per_node is None:
            raise PlacementError(
                "num_nodes",
                "num_nodes needs gpus_per_node to size the cluster.",
                "Also give gpus_per_node (GPUs on each node).",
            )
    if cluster_gpus is not None:
        require_int(cluster_gpus, "cluster_gpus", minimum=1)
        if num_nodes is not None and gpus_per_node is not None and cluster_gpus != num_nodes * gpus_per_node:
            raise PlacementError(
                "cluster_gpus",
                f"cluster_gpus = {cluster_gpus} but num_nodes x gpus_per_node = "
                f"{num_nodes} x {gpus_per_node} = {num_nodes * gpus_per_node}.",
                "Give either cluster_gpus or num_nodes and gpus_per_node.",
            )
        if gpus_per_node is not None and cluster_gpus % gpus_per_node:
            raise PlacementError(
                "cluster_gpus",
                f"{cluster_gpus} GPUs do not fill whole nodes of {gpus_per_node}.",
                "Make cluster_gpus a multiple of gpus_per_node.",
            )
        return cluster_gpus
    if num_nodes is not None:
        return num_nodes * gpus_per_node  # type: ignore[operator]
    return None


def require_int(value: object, field: str, *, minimum: int) -> int:
    """``value`` if it is a whole number >= ``minimum`` (bools are not numbers here), else a PlacementError."""
    fix = f"Give {field} a whole number >= {minimum}."
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlacementError(field, f"expected a whole number, got {value!r}.", fix)
    if value < minimum:
        raise PlacementError(field, f"must be at least {minimum}, got {value}.", fix)
    return value
