"""The step timeline file: one JSON line per step, phases in wall-clock time; a resumed run appends."""

import json

from hybrid_algos.train.timeline import TimelineWriter
from hybrid_core.stats import PhaseTimer


def test_timeline_lines_from_phase_timer_and_append_on_resume(tmp_path):
    path = tmp_path / "run" / "timeline.jsonl"
    timer = PhaseTimer()
    with timer.phase("generate"):
        pass
    timer.add("sync", 0.5, 10, end=2000.0)
    writer = TimelineWriter(str(path))
    writer(0, timer.spans)
    writer.close()
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["step"] == 0 and [p for p, _, _ in line["spans"]] == ["generate", "sync"]
    assert line["spans"][1][1:] == [1999.5, 2000.0]

    resumed = TimelineWriter(str(path), append=True)
    resumed(1, [("train", 1.0, 2.0)])
    resumed.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1]
    TimelineWriter(str(path)).close()
    assert path.read_text() == ""  # a fresh run starts the file afresh
