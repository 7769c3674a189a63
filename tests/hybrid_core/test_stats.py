"""PhaseTimer: seconds and bytes per phase, and the wall-clock spans that attribute outside samples to a phase."""

import time

from hybrid_core.stats import PhaseTimer, TransferStats


def test_phase_blocks_accumulate_and_leave_ordered_wall_clock_spans():
    timer = PhaseTimer()
    before = time.time()
    with timer.phase("generate"):
        time.sleep(0.02)
    timer.add("sleep", 0.5, 1000, end=before + 10.0)
    with timer.phase("generate"):
        time.sleep(0.01)
    after = time.time()

    assert timer.seconds["generate"] >= 0.03
    assert timer.bytes == {"generate": 0, "sleep": 1000}
    assert [s[0] for s in timer.spans] == ["generate", "sleep", "generate"]
    first, given, last = timer.spans
    assert before <= first[1] < first[2] <= last[1] < last[2] <= after
    assert given[1:] == (before + 9.5, before + 10.0)  # an explicit end places the block where it happened
    assert abs((first[2] - first[1]) + (last[2] - last[1]) - timer.seconds["generate"]) < 1e-3


def test_transfer_rate_is_bytes_over_seconds_and_zero_when_untimed():
    assert TransferStats(2_000_000_000, 0.5).gbps == 4.0
    assert TransferStats(10, 0.0).gbps == 0.0
    assert (TransferStats(1, 1.0, "a") + TransferStats(2, 2.0)).as_dict() == {
        "what": "a",
        "bytes": 3,
        "seconds": 3.0,
        "gbps": 1e-9,
    }
