"""The built-in engine with one change for the partial-rollout test: a generation holds after its first sampled token
until a weight update pauses it (or ``HOLD_S`` passes), so every generation that overlaps training is still running
when the trainer's weight update comes -- whatever the speed of the machine -- and carries tokens of two versions.

The pause, the weight load and the resume are the built-in engine's own; only the timing is taken out of the test.
Registered by the test with ``register_engine("hf-paced", "paced_engine:PacedHFEngine")``; the engine actor imports
this file through the ``PYTHONPATH`` the driver forwards.
"""

from __future__ import annotations

import time

from hybrid_engines.hf_engine import HFEngine

#: the longest a generation waits for the update (the first one, which the trainer itself waits for, never holds)
HOLD_S = 30.0


class PacedHFEngine(HFEngine):
    # class-level starting values: the constructor stays the built-in engine's (its signature is what the engine
    # actor reads to pass its arguments)
    _generations = 0  # generate calls so far
    _forwards = 0  # forward passes of the current generate call

    def generate(self, prompt_token_ids, params):
        with self._cond:
            self._generations += 1
            self._forwards = 0
        return super().generate(prompt_token_ids, params)

    def _before_forward(self) -> int:
        with self._cond:
            self._forwards += 1
            # before the second forward pass: one token of every row is sampled with the weights held now
            if self._generations > 1 and self._forwards == 2:
                version, ends = self._version, time.monotonic() + HOLD_S
                while not self._paused and self._version == version and time.monotonic() < ends:
                    self._cond.wait(0.05)
        return super()._before_forward()  # parks here while the update is under way
