"""Every test process: Ray clusters started by tests authenticate with a token of the process's own and listen on the
loopback interface only (as a local ``hybrid`` run does, see hybrid_core.cluster). Set before Ray is imported, so
that tests calling ``ray.init`` directly get it too; a RAY_AUTH_MODE chosen outside (e.g. ``disabled``) is kept."""

import os
import secrets

if "RAY_AUTH_MODE" not in os.environ:
    os.environ["RAY_AUTH_MODE"] = "token"
    # In the environment rather than ~/.ray/auth_token: parallel test processes would race to create that file.
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's local-only mode: node IP 127.0.0.1
