"""Connect to Ray: a running cluster (``run.address``, RAY_ADDRESS, or inside ``ray job submit``) or a new local one.

A new local Ray gets a configurable temp dir and bounded logs (the seed's /tmp filled with /tmp/ray logs and took a
machine down), and it is closed to the network:

* **Bound to the loopback interface.** Ray's GCS, raylet, driver and actors serve gRPC on the node's IP, which Ray
  takes from the machine's network interface -- so a local run was reachable by anyone on the network, and a Ray
  cluster runs any code it is sent. A local run needs no other machine, so its node IP is 127.0.0.1 and every Ray
  server listens there only. (Ray has no public switch for this on Linux: ``ray.init(_node_ip_address="127.0.0.1")``
  is turned back into the machine's IP unless Ray's "local cluster only" mode, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
  = 0, is on while the node starts. That mode is switched on around the start only, so that joining a real
  cluster later in the same process is unaffected, and the result is checked.)
* **Token authentication.** Unless ``RAY_AUTH_MODE`` is set already, a local run uses Ray's token authentication
  (Ray >= 2.52) with a random token of its own, given to Ray's processes through ``RAY_AUTH_TOKEN`` (so no token file
  is shared between concurrent runs): another user of the same machine cannot use the cluster either.

A new local Ray's processes (GCS, raylet, and so every worker) get **a process group of their own**: SIGTERM to
the run's process group (``kill -- -PGID``, a terminal's Ctrl-C) reaches the driver only, which then ends the run
in order -- a checkpoint first on SIGTERM -- instead of Ray's processes dying under it. (They still end with the
driver: Ray ties them to it with the kernel's parent-death signal, the only case in which this is done.)

Joining a running cluster first checks, within a deadline, that something answers at the address and that it is a
Ray GCS (``ray.init`` retries a closed port or a port of another service forever, printing nothing useful).

Joining a running cluster (multi-node) changes nothing about how that cluster was started: start it with
``RAY_AUTH_MODE=token`` on every node (see the README's multi-node section). hybrid warns when it joins a cluster
without token authentication.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import socket
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from . import versions
from .errors import ConfigError, RoleFailure

log = logging.getLogger(__name__)

#: Ray's "local cluster only" switch: the node IP is the loopback address (see the module docstring).
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
#: The oldest Ray with token authentication (``RAY_AUTH_MODE=token``): the floor hybrid-core declares.
RAY_FLOOR = "2.52"


@dataclass(frozen=True)
class ClusterInfo:
    address: str
    started_here: bool
    num_gpus: int
    num_cpus: int
    num_nodes: int = 1
    node_ip: str = ""


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

    # an older Ray ignores RAY_AUTH_MODE: the cluster would take any client (an install with --no-deps can have one)
    versions.require("ray", ray.__version__, RAY_FLOOR, "token authentication of the cluster (RAY_AUTH_MODE=token)")
    if ray.is_initialized():
        return _info(started_here=False)
    given = address
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        if num_gpus is not None:
            raise ConfigError(
                "run.num_gpus",
                f"cannot declare GPUs when joining the running cluster at {address}.",
                "Drop run.num_gpus; the cluster's own GPUs are used.",
            )
        check_gcs(
            address, source="RAY_ADDRESS" if address == os.environ.get("RAY_ADDRESS") and not given else "run.address"
        )
        ray.init(address=address, log_to_driver=True)
        _warn_if_unauthenticated(address)
        return _info(started_here=False)
    # Bounded log files: Ray reads these when its processes start, so they are set before ray.init.
    os.environ.setdefault("RAY_ROTATION_MAX_BYTES", str(log_max_mb * 1024 * 1024))
    os.environ.setdefault("RAY_ROTATION_BACKUP_COUNT", str(log_backups))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    use_local_token()
    if temp_dir is not None:
        temp_dir = make_temp_dir(temp_dir)
    # address="local": always a new cluster of our own. Without it Ray joins any cluster already running on this
    # machine (found through /tmp/ray), someone else's included.
    with loopback_only(), gpus_hidden_as_fakes(num_gpus), own_process_group():
        for attempt in (1, 2):
            try:
                ray.init(
                    address="local",
                    num_gpus=num_gpus,
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    _temp_dir=temp_dir,
                    log_to_driver=True,
                    logging_level=logging.WARNING,
                    _node_ip_address="127.0.0.1",
                )
                break
            except Exception as e:  # Ray's own start-up failure (a bare Exception), not a bug of the caller's
                if "timed out during startup" not in str(e):
                    raise
                try:
                    ray.shutdown()  # what did start of this node goes before the next try
                except Exception:  # noqa: BLE001 - the start-up error is the one to report
                    pass
                if attempt == 2:
                    raise RoleFailure(
                        f"the local Ray did not start: its node timed out during start-up twice "
                        f"({_first_line(e)}). Ray gives its processes a fixed 30 s to register; a "
                        "machine this busy delays them past it. Fix: run again when the machine is "
                        "less loaded."
                    ) from None
                log.warning(
                    "the local Ray's node did not register within Ray's fixed 30 s (a loaded machine?): "
                    "starting it once more"
                )
    info = _info(started_here=True)
    if not is_loopback(info.node_ip):
        log.warning(
            "the local Ray listens on %s, not on 127.0.0.1 only: this Ray version ignored its local-only "
            "mode, so the run is reachable from the network (token authentication is %s)",
            info.node_ip,
            os.environ.get(AUTH_MODE_ENV, "Ray's default"),
        )
    return info


def make_temp_dir(path: str) -> str:
    """The absolute ``run.ray_temp_dir``, created; a path that cannot be a folder (a file on it, no permission) is a
    :class:`ConfigError` naming the setting."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # NotADirectoryError (a file in the path), FileExistsError (a file there), PermissionError
        blocker = next((p for p in _ancestors(path) if os.path.exists(p) and not os.path.isdir(p)), None)
        why = f"{blocker!r} is a file, not a folder" if blocker else e.strerror or type(e).__name__
        raise ConfigError(
            "run.ray_temp_dir",
            f"cannot create the folder {path!r}: {why}.",
            "Give a folder that can be created (or leave run.ray_temp_dir out: Ray's /tmp/ray).",
        ) from None
    return path


def _ancestors(path: str) -> list[str]:
    """``path`` and the folders above it, top first."""
    parts = [path]
    while os.path.dirname(parts[-1]) != parts[-1]:
        parts.append(os.path.dirname(parts[-1]))
    return parts[::-1]


#: How long joining a cluster may take to find out that nothing (or no Ray) answers at its address.
CONNECT_TIMEOUT_S = 20.0


def check_gcs(address: str, *, source: str = "run.address", timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse (a :class:`ConfigError` naming ``source``) an address where nothing answers or no Ray GCS does.

    ``auto`` and Ray Client addresses (``ray://``) are left to Ray."""
    host, port = _host_port(address)
    if host is None:
        return
    fix = (
        "Start the cluster first (`ray start --head` on its head node), or give its GCS address (host:6379, "
        "what `ray start --head` prints); without an address hybrid starts a Ray of its own."
    )
    if source == "RAY_ADDRESS":
        fix = "Unset RAY_ADDRESS (a stale one: hybrid then starts a Ray of its own), or " + fix[0].lower() + fix[1:]
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, 10.0)):
            pass
    except OSError as e:
        raise ConfigError(source, f"nothing answers at {address} ({e.strerror or type(e).__name__}).", fix) from None
    if not _answers_as_gcs(host, port, timeout_s):
        raise ConfigError(
            source,
            f"{address} answers, but not as a Ray cluster's GCS (no reply to Ray's "
            f"CheckAlive within {timeout_s:g} s): another service's port, or the dashboard's (8265).",
            fix,
        )


def _host_port(address: str) -> tuple[str | None, int]:
    if address in ("auto", "local") or address.startswith("ray://"):
        return None, 0
    rest = address.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return None, 0
    return host.strip("[]"), int(port)


def _answers_as_gcs(host: str, port: int, timeout_s: float) -> bool:
    """Whether a gRPC server of Ray's GCS answers (a refusal for want of the token counts: it is Ray's)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True  # a TLS cluster: the plain-text probe cannot tell; Ray's own connect decides
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:
        return True
    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).CheckAlive(
            gcs_service_pb2.CheckAliveRequest(), timeout=timeout_s
        )
        return True
    except grpc.RpcError as e:
        return e.code() not in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.INTERNAL,
        )
    finally:
        channel.close()


def gcs_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether the GCS port at ``address`` still accepts connections (a dead GCS makes every Ray call wait)."""
    host, port = _host_port(address or "")
    if host is None:
        return True
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def own_process_group() -> Iterator[None]:
    """Ray's processes started in the block lead a process group of their own (see the module docstring).

    Only where Ray ties them to the driver with the parent-death signal (Linux): without it Ray's reaper finds
    them by the driver's process group, which must then stay theirs."""
    try:
        from ray._private import services
        from ray._private.utils import detect_fate_sharing_support

        supported = os.name == "posix" and detect_fate_sharing_support()
    except (ImportError, AttributeError):
        supported = False
    if not supported:
        yield
        return
    original = services.ConsolePopen

    class OwnGroup(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            inner = kwargs.get("preexec_fn")

            def preexec() -> None:
                os.setpgid(0, 0)
                if inner is not None:
                    inner()

            kwargs["preexec_fn"] = preexec
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroup
    try:
        yield
    finally:
        services.ConsolePopen = original


def use_local_token(environ: MutableMapping[str, str] | None = None) -> None:
    """Token authentication with a fresh random token for a new local Ray, unless RAY_AUTH_MODE is set already."""
    env = os.environ if environ is None else environ
    if AUTH_MODE_ENV in env:
        return
    env[AUTH_MODE_ENV] = "token"
    env.setdefault(AUTH_TOKEN_ENV, secrets.token_hex(32))
    if environ is not None:
        return
    try:  # Ray's C++ config read the (unset) mode when ray was imported: have it read the variables again
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):
        pass


#: Values of CUDA_VISIBLE_DEVICES that hide every GPU (CUDA stops at the first id it does not know).
HIDDEN_GPUS = ("", "-1", "NoDevFiles")


@contextlib.contextmanager
def gpus_hidden_as_fakes(num_gpus: int | None) -> Iterator[None]:
    """A CPU run on a GPU machine (``CUDA_VISIBLE_DEVICES=`` hides the GPUs) declares fake GPUs as a CPU machine does.

    Ray refuses to declare more GPUs than CUDA_VISIBLE_DEVICES lists, and hands each actor the ids it declared. So
    while the node starts, the declared GPUs get ids no CUDA device has (-1, -2, ...): Ray accepts them, and every
    worker Ray gives one sees no GPU, as on a machine without any."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not num_gpus or hidden is None or hidden.strip() not in HIDDEN_GPUS:
        yield
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(-1 - i) for i in range(num_gpus))
    try:
        yield
    finally:
        os.environ["CUDA_VISIBLE_DEVICES"] = hidden


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Ray's local-only mode while a node starts (it then takes 127.0.0.1 as its IP), restored afterwards."""
    constants: Any = None  # ray._private.ray_constants once imported
    try:  # Ray reads the variable into a module constant when first imported (before we set it): set both
        from ray._private import ray_constants as constants  # type: ignore[no-redef]

        previous = constants.ENABLE_RAY_CLUSTER
        constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError):
        constants = None
    before = os.environ.get(LOCAL_ONLY_ENV)
    os.environ[LOCAL_ONLY_ENV] = "0"  # for the processes the node starts
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(LOCAL_ONLY_ENV, None)
        else:
            os.environ[LOCAL_ONLY_ENV] = before
        if constants is not None:
            constants.ENABLE_RAY_CLUSTER = previous


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _warn_if_unauthenticated(address: str) -> None:
    if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
        log.warning(
            "joined the Ray cluster at %s without token authentication (RAY_AUTH_MODE=%s): anyone who can "
            "reach its ports can run code on it. Start every node with RAY_AUTH_MODE=token and the same "
            "RAY_AUTH_TOKEN (README: multi-node).",
            address,
            os.environ.get(AUTH_MODE_ENV, "unset"),
        )


def _info(started_here: bool) -> ClusterInfo:
    import ray

    resources = ray.cluster_resources()
    context = ray.get_runtime_context()
    address = context.gcs_address
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return ClusterInfo(
        address=address,
        started_here=started_here,
        num_gpus=int(resources.get("GPU", 0)),
        num_cpus=int(resources.get("CPU", 0)),
        num_nodes=len(nodes),
        node_ip=address.rsplit(":", 1)[0],
    )


def shutdown(info: ClusterInfo) -> None:
    """Stop Ray if this process started it; leave a shared cluster alone (just disconnect)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
