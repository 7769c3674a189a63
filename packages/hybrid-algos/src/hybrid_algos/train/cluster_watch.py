"""Notice at once when Ray's GCS (the cluster's head process) is gone, instead of after Ray's own 60 s.

Without its GCS no Ray call can succeed, but Ray's client keeps retrying for ``gcs_rpc_server_reconnect_timeout_s``
(60 s) and then ends the driver process with its own message. A thread here connects to the GCS port once a second;
after a few refused connections in a row it marks the cluster lost and interrupts the main thread (SIGINT), which
ends the run with a hybrid error naming the cause and the checkpoint to resume from.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

log = logging.getLogger(__name__)


class ClusterWatch:
    """``with ClusterWatch(gcs_address): ...``; ``lost`` tells whether the GCS went away during the block."""

    def __init__(self, gcs_address: str, *, interval_s: float = 1.0, misses: int = 5, connect_timeout_s: float = 2.0):
        host, _, port = (gcs_address or "").rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port) if port.isdigit() else 0
        self.address = gcs_address
        self.interval_s, self.misses, self.connect_timeout_s = interval_s, misses, connect_timeout_s
        self.lost = False
        self.lost_after_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sigint_before: int | signal.Handlers | None = None  # SIG_IGN / SIG_DFL (not Python's handler)

    def __enter__(self) -> ClusterWatch:
        if self.port and threading.current_thread() is threading.main_thread():
            # A command started in the background by a script (`hybrid ppo ... &`) inherits SIGINT ignored: then the
            # interrupt below would be dropped. Python's own handler for the block, the caller's back after it.
            before = signal.getsignal(signal.SIGINT)
            if not callable(before):
                self._sigint_before = before
                signal.signal(signal.SIGINT, signal.default_int_handler)
            self._thread = threading.Thread(target=self._watch, name="hybrid-cluster-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._sigint_before is not None:
            signal.signal(signal.SIGINT, self._sigint_before)
            self._sigint_before = None

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s):
                return True
        except OSError:
            return False

    def _watch(self) -> None:
        missed, first_miss = 0, 0.0
        while not self._stop.wait(self.interval_s):
            if self._answers():
                missed = 0
                continue
            missed += 1
            first_miss = first_miss if missed > 1 else time.monotonic()
            if missed >= self.misses and not self._stop.is_set():
                self.lost = True
                self.lost_after_s = time.monotonic() - first_miss
                log.debug("Ray GCS at %s does not answer: interrupting the run", self.address)
                # A real SIGINT to the main thread: a KeyboardInterrupt there (turned into ClusterLost by the loop),
                # which also cuts short a blocking call that a mere interrupt flag would wait out.
                main = threading.main_thread().ident
                assert main is not None  # the main thread has started: it runs this program
                signal.pthread_kill(main, signal.SIGINT)
                return
