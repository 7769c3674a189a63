"""Every test process: Ray clusters started by tests authenticate with a token of the process's own and listen on the
loopback interface only (as a local ``hybrid`` run does, see hybrid_core.cluster). Set before Ray is imported, so
that tests calling ``ray.init`` directly get it too; a RAY_AUTH_MODE chosen outside (e.g. ``disabled``) is kept."""

import os
import secrets
import sys
import warnings

import pytest

if "RAY_AUTH_MODE" not in os.environ:
    os.environ["RAY_AUTH_MODE"] = "token"
    # In the environment rather than ~/.ray/auth_token: parallel test processes would race to create that file.
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's local-only mode: node IP 127.0.0.1
# With accelerate installed (peft needs it) transformers imports DeepSpeed with its modelling code, and DeepSpeed's
# fallback to the CPU warns on stdout, which the dry-run goldens would read as a change; a CPU-only torch build can
# only ever get that accelerator, so naming it is the same choice without the warning.
if "DS_ACCELERATOR" not in os.environ:
    import torch

    if torch.version.cuda is None:
        os.environ["DS_ACCELERATOR"] = "cpu"


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_behind(request):
    """A test module that leaves Ray initialised would hand its cluster (its GPUs, its temp dir, its logs) to the next
    module the same xdist worker runs, which then fails for a reason of another file: end it after the module, and
    name the module that left it (a warning in the summary) so the leak itself gets fixed."""
    yield
    ray = sys.modules.get("ray")  # never imported here: a module that did not use Ray costs nothing
    if ray is not None and ray.is_initialized():
        warnings.warn(f"{request.module.__name__} left Ray initialised; shut down after the module", stacklevel=1)
        ray.shutdown()
