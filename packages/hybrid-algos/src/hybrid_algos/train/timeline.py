"""``<run_dir>/timeline.jsonl``: when each phase of each step ran, in wall-clock (Unix) seconds.

The metrics say how long a phase took; the timeline says when, so that what was measured outside the run at the
same moment (GPU memory per GPU, say: bench/gpu_sampler.py) can be attributed to a phase. One line per step:
``{"step": 3, "spans": [["wake", t0, t1], ["generate", t1, t2], ...]}``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence


class TimelineWriter:
    def __init__(self, path: str, *, append: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # open for the writer's life (every step appends; close() ends it): no `with` block fits
        self._file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def __call__(self, step: int, spans: Sequence[tuple[str, float, float]]) -> None:
        self._file.write(
            json.dumps({"step": step, "spans": [[p, round(a, 6), round(b, 6)] for p, a, b in spans]}) + "\n"
        )
        self._file.flush()

    def close(self) -> None:
        self._file.close()
