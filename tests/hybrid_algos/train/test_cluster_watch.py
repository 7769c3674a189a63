"""The watch on Ray's GCS: a port that stops accepting connections interrupts the main thread within seconds, one
that keeps answering never does."""

import signal
import socket
import time

import pytest

from hybrid_algos.train.cluster_watch import ClusterWatch


def _listening():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    return server, f"127.0.0.1:{server.getsockname()[1]}"


def _gcs_dies_during_the_run() -> None:
    server, address = _listening()
    watch = ClusterWatch(address, interval_s=0.2, misses=3)
    finished = []
    with pytest.raises(KeyboardInterrupt), watch:
        time.sleep(0.6)
        server.close()  # the GCS dies
        time.sleep(30)  # the run, waiting on a Ray call
        finished.append(True)
    assert watch.lost and not finished  # the watch interrupted the wait, it did not run out


def test_a_gcs_that_goes_away_interrupts_the_run():
    _gcs_dies_during_the_run()


def test_it_interrupts_a_run_started_in_the_background_with_sigint_ignored():
    # A script's `hybrid ppo ... &` (non-interactive shell, no job control) runs with SIGINT ignored.
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _gcs_dies_during_the_run()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # the caller's disposition is back
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_gcs_that_answers_is_left_alone():
    server, address = _listening()
    try:
        with ClusterWatch(address, interval_s=0.1, misses=2) as watch:
            time.sleep(1.0)
        assert not watch.lost
    finally:
        server.close()
