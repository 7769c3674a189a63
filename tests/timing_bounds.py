"""Bounds on waiting in the tests: they catch hangs, never measure speed (speed belongs in bench/).

A test that checks a deadline asserts that the deadline fired (the error names it, the work was still blocked when
it did); a bound from here only makes a hang fail the test instead of the CI job. Both are far above anything a loaded
2-core CI machine needs."""

#: A call that its own deadline (seconds in the tests) or a failure detector should have ended.
HANG_S = 60.0
#: A short end-to-end run (a local Ray, tiny models, a few steps) that should have ended on its own.
RUN_HANG_S = 400.0
