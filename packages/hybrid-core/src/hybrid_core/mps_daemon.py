"""CUDA MPS as part of a run (``run.mps auto|on|off``): whether the run starts a control daemon of its own, the daemon's
life (started before Ray starts any worker, stopped when the run ends, however it ends), and the SM shares of the
engines and the trainers under it.

* ``off`` (the default): nothing changes; the run's notes say whether an MPS daemon of someone else's serves the
  GPUs (:mod:`hybrid_core.mps`). Off by default because starting a daemon is a side effect on the machine (a
  process, a server per GPU for as long as the run lives) and its gain is measured by hand only (bench/async_gpu.py
  its MPS option), not by the run; a run asks for it.
* ``on``: the run starts ``nvidia-cuda-mps-control -d`` with a private ``CUDA_MPS_PIPE_DIRECTORY`` (a fresh folder
  under the run's temp folder, ``run.ray_temp_dir`` or the system's) and ``CUDA_MPS_LOG_DIRECTORY`` (``<run
  folder>/logs/mps``), gives both variables to every worker it starts (:func:`hybrid_core.runtime_env
  .set_worker_env`), and at the end sends ``quit`` to the same pipe folder and removes it (``finally`` and
  ``atexit``: an exception, Ctrl-C and SIGTERM included; a SIGKILL of the driver leaves the daemon, which ``echo quit
  | CUDA_MPS_PIPE_DIRECTORY=<folder> nvidia-cuda-mps-control`` ends). No GPU setting changes (no ``nvidia-smi -c``).
  Where the daemon cannot start the run is refused (a :class:`ConfigError` naming ``run.mps``) before Ray starts:
  no ``nvidia-cuda-mps-control`` on PATH, no CUDA GPU, a joined Ray cluster (its workers run on nodes whose MPS
  this run does not own), an MPS daemon or server already running here (another user's or run's: a GPU is served
  by one MPS server), or a daemon that does not open its control pipe within :data:`START_TIMEOUT_S`.
* ``auto``: ``on`` when the run overlaps generation with training on shared GPUs (asynchronous mode ``shared``) and
  the daemon can start; otherwise off, with one start-up note saying why.

SM shares: under MPS each client process may be limited to a share of the GPU's SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), read once, when the process creates its CUDA context. With
``run.mps_engine_share P`` the engines start with P percent and every other worker (trainers, frozen models) with
100 - P; without it no share is set (every process may use every SM: MPS's own default). Only in the ``shared``
mode: where the two sides take turns a share only slows each phase. During the run :class:`ShareAdvisor` reads each
step's phase times and records the split :func:`choose_sm_shares` would choose (``mps/*`` metrics) and a note when
the phase times drift from the ones it chose by (more than 25 %): applying a new split needs the engines and
trainers restarted, which the run does not do -- the note names the setting for the next run.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .errors import ConfigError
from .mps import DEFAULT_PIPE_DIRECTORY, mps_pipe_directory

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
#: How long the daemon has to open its control pipe after ``-d``.
START_TIMEOUT_S = 10.0
#: How long ``quit`` may take (the servers end once their clients have: Ray's workers are gone by then).
STOP_TIMEOUT_S = 30.0
_FIX_ON = "Drop run.mps on (or use run.mps auto, which runs without MPS where it cannot start)."


# ---- the decision (before Ray) --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MpsDecision:
    """What a run does about MPS: ``start`` a daemon of its own or not, one line saying so and why, and the SM shares
    (engine %, trainer %) its processes start with (None: none set)."""

    mode: str = "off"
    start: bool = False
    note: str = ""
    shares: tuple[int, int] | None = None

    def engine_env(self) -> dict[str, str]:
        """The engines' own variable (their SM share), on top of what every worker gets."""
        return {SHARE_ENV: str(self.shares[0])} if self.start and self.shares else {}

    def trainer_env(self) -> dict[str, str]:
        """Every other worker's SM share (set for all workers; the engines' :meth:`engine_env` overrides it)."""
        return {SHARE_ENV: str(self.shares[1])} if self.start and self.shares else {}


def cuda_gpu_count() -> int:
    """CUDA GPUs this process sees (0 without a driver, a CUDA build of torch, or with ``CUDA_VISIBLE_DEVICES``
    hiding them). Creates no CUDA context."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1", "NoDevFiles"):
        return 0
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.version.cuda else 0
    except Exception:  # noqa: BLE001 - no driver, a broken install: no GPU to count
        return 0


def mps_servers(proc: str = "/proc") -> list[int]:
    """Pids of MPS control daemons and servers running on this machine (their command line names the binary)."""
    found = []
    for entry in os.listdir(proc) if os.path.isdir(proc) else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(os.path.join(proc, entry, "cmdline"), "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except OSError:
            continue
        if os.path.basename(argv0).decode(errors="replace") in (CONTROL, "nvidia-cuda-mps-server"):
            found.append(int(entry))
    return found


def why_not(
    *,
    joined_cluster: str | None = None,
    env: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] | None = None,
    gpus: Callable[[], int] | None = None,
    running: Callable[[], Sequence[int]] | None = None,
) -> str | None:
    """Why this run cannot start an MPS daemon of its own here (a clause), or None when it can. The probes default
    to this module's (looked up at the call, so a test may replace them)."""
    env = os.environ if env is None else env
    which = which or shutil.which
    gpus = gpus or cuda_gpu_count
    running = running or mps_servers
    if which(CONTROL) is None:
        return f"{CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities)"
    if gpus() == 0:
        return "this machine shows no CUDA GPU (none, no driver, or CUDA_VISIBLE_DEVICES hides them)"
    if joined_cluster:
        return (
            f"the run joins the Ray cluster at {joined_cluster}, whose workers start on nodes whose MPS this run "
            "does not own (start MPS on every node yourself, or run a local Ray)"
        )
    folder = mps_pipe_directory(env) or mps_pipe_directory({PIPE_ENV: DEFAULT_PIPE_DIRECTORY})
    if folder is not None:
        return (
            f"an MPS control daemon already runs with its pipe in {folder} (one MPS server serves a GPU): the "
            "run's processes join it as they are with run.mps off"
        )
    pids = running()
    if pids:
        return (
            f"MPS processes already run on this machine (pid {', '.join(map(str, pids[:4]))}), of another user or "
            "run, with a pipe folder of their own: one MPS server serves a GPU"
        )
    return None


def decide(
    mode: str,
    *,
    async_mode: str,
    engine_share: int | None = None,
    joined_cluster: str | None = None,
    probe: Callable[..., str | None] = why_not,
) -> MpsDecision:
    """The run's MPS decision (``async_mode``: :func:`hybrid_algos.train.async_rollout.async_mode`'s). ``on`` where
    it cannot start raises a :class:`ConfigError` naming ``run.mps``; ``auto`` resolves to on or off with its note."""
    if mode == "off":
        return MpsDecision()
    problem = probe(joined_cluster=joined_cluster)
    if mode == "on" and problem is not None:
        raise ConfigError("run.mps", f"run.mps on cannot start CUDA MPS here: {problem}.", _FIX_ON)
    if mode == "auto" and problem is not None:
        return MpsDecision(mode, note=f"run.mps auto: off, CUDA MPS cannot start here: {problem}")
    if mode == "auto" and async_mode != "shared":
        return MpsDecision(
            mode,
            note=f"run.mps auto: off, the run does not overlap generation with training on shared GPUs "
            f"(asynchronous mode {async_mode})",
        )
    shares = None
    if engine_share is not None and async_mode == "shared":
        shares = (int(engine_share), 100 - int(engine_share))
    if shares:
        split = f"SM shares: engines {shares[0]} %, trainers {shares[1]} % ({SHARE_ENV}, set at each process's start)"
    elif async_mode == "shared":
        split = "no SM shares (every process may use every SM; run.mps_engine_share sets one)"
    else:
        split = (
            f"no SM shares (asynchronous mode {async_mode}: the engines and the trainers do not run at the same "
            "time on one GPU)"
        )
    why = "asked for" if mode == "on" else "the run overlaps generation with training on shared GPUs"
    return MpsDecision(
        mode, True, f"run.mps {mode}: the run starts a CUDA MPS control daemon of its own ({why}); {split}", shares
    )


# ---- the daemon -----------------------------------------------------------------------------------------------------
class MpsDaemon:
    """One run's MPS control daemon: private pipe and log folders, :meth:`start` before Ray, :meth:`stop` at the end
    (idempotent; also registered with ``atexit``)."""

    def __init__(self, log_dir: str, temp_root: str | None = None, *, binary: str = CONTROL):
        self.binary = binary
        self.temp_root = temp_root
        self.log_dir = log_dir
        self.pipe_dir = ""
        self._own_root = ""
        self.running = False

    @property
    def env(self) -> dict[str, str]:
        """The two variables every worker of the run gets."""
        return {PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir}

    def _daemon_env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def start(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, str]:
        """Start the daemon and wait for its control pipe; a daemon that does not come up is a ConfigError (what it
        started is stopped first)."""
        if self.temp_root:
            os.makedirs(self.temp_root, exist_ok=True)
        # short and private: the pipe folder holds named pipes (and the server's sockets, whose paths are short)
        self._own_root = tempfile.mkdtemp(prefix="hybrid-mps-", dir=self.temp_root or None)
        self.pipe_dir = os.path.join(self._own_root, "pipe")
        os.makedirs(self.pipe_dir, mode=0o700)
        os.makedirs(self.log_dir, exist_ok=True)
        atexit.register(self.stop)
        try:
            done = subprocess.run(
                [self.binary, "-d"],
                env=self._daemon_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            self.stop()
            raise ConfigError("run.mps", f"{self.binary} -d did not start: {e}.", _FIX_ON) from None
        self.running = True
        if done.returncode != 0:
            out = (done.stderr or done.stdout or "").strip().splitlines()
            self.stop()
            raise ConfigError(
                "run.mps",
                f"{self.binary} -d exited with status {done.returncode}"
                + (f" ({out[-1]})" if out else "")
                + f"; its log: {self.log_dir}.",
                _FIX_ON,
            )
        ends = time.monotonic() + timeout_s
        while mps_pipe_directory(self.env) is None:
            if time.monotonic() >= ends:
                self.stop()
                raise ConfigError(
                    "run.mps",
                    f"the CUDA MPS control daemon did not open its pipe in {self.pipe_dir} within {timeout_s:g} s "
                    f"(its log: {self.log_dir}).",
                    _FIX_ON,
                )
            time.sleep(0.05)
        log.info("CUDA MPS: control daemon started (pipe %s, log %s)", self.pipe_dir, self.log_dir)
        return self.env

    def stop(self) -> None:
        """``quit`` to the daemon (same pipe folder), then the private folder removed. Never raises."""
        try:
            if self.running:
                self.running = False
                try:
                    subprocess.run(
                        [self.binary],
                        input="quit\n",
                        text=True,
                        env=self._daemon_env(),
                        capture_output=True,
                        timeout=STOP_TIMEOUT_S,
                    )
                except (OSError, subprocess.TimeoutExpired) as e:
                    log.warning(
                        "CUDA MPS: 'quit' to the control daemon failed (%s): end it with `echo quit | "
                        "CUDA_MPS_PIPE_DIRECTORY=%s %s`",
                        e,
                        self.pipe_dir,
                        self.binary,
                    )
                    return  # its pipe folder stays: the command above needs it
                _wait_closed(self.pipe_dir, 5.0)
            if self._own_root:
                shutil.rmtree(self._own_root, ignore_errors=True)
                self._own_root = ""
        finally:
            atexit.unregister(self.stop)


@contextlib.contextmanager
def daemon_for_run(
    decision: MpsDecision | None, log_dir: str, temp_root: str | None = None
) -> Iterator[MpsDaemon | None]:
    """The run's daemon around the whole run (enter before Ray starts any worker): every worker started inside gets
    the pipe and log folders and the trainers' SM share (the engines add :meth:`MpsDecision.engine_env`); on the
    way out, however the run ends, the variables are taken back and the daemon stopped. Nothing without a start."""
    if decision is None or not decision.start:
        yield None
        return
    from .runtime_env import drop_worker_env, set_worker_env

    daemon = MpsDaemon(log_dir, temp_root)
    try:
        set_worker_env({**daemon.start(), **decision.trainer_env()})
        yield daemon
    finally:
        drop_worker_env((PIPE_ENV, LOG_ENV, SHARE_ENV))
        daemon.stop()


def _wait_closed(pipe_dir: str, seconds: float) -> None:
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        try:
            if not stat.S_ISFIFO(os.stat(os.path.join(pipe_dir, "control")).st_mode):
                return
        except OSError:
            return
        time.sleep(0.05)


# ---- SM shares ------------------------------------------------------------------------------------------------------
def choose_sm_shares(
    generate_s: float, train_s: float, *, total: int = 100, floor: int = 10, step: int = 5
) -> tuple[int, int]:
    """(engine %, trainer %) of the SMs for two processes that run at the same time on one GPU.

    The rule: each side's share in proportion to the time its phase took (``generate_s`` with every SM it wanted,
    ``train_s`` the trainer side's, inference passes included), so that if both slowed in inverse proportion to
    their share they would end together; rounded to a multiple of ``step``, each at least ``floor`` (a side never
    starves), the two summing to ``total``. Times that are not positive and finite give the even split. A model,
    not a measurement: decode is bound by memory bandwidth more than by SMs, so the split is a starting point."""
    if not (math.isfinite(generate_s) and math.isfinite(train_s)) or generate_s < 0 or train_s < 0:
        generate_s = train_s = 1.0
    if generate_s + train_s <= 0:
        generate_s = train_s = 1.0
    exact = total * generate_s / (generate_s + train_s)
    engine = round(exact / step) * step
    engine = min(max(engine, floor), total - floor)
    return engine, total - engine


class ShareAdvisor:
    """Reads each step's phase times; records the split :func:`choose_sm_shares` picks and when they drift.

    After ``warmup`` steps, the median generate / trainer-side ratio over ``window`` steps gives the suggested split
    (said once in a note); later, a median ratio more than ``drift`` (25 %) away from the one the last suggestion
    came from calls for a new split (``mps/drift`` 1, a new note). The processes keep the split they started with
    (``applied``; (100, 100): none set): CUDA reads it at context creation, and the run restarts no process."""

    def __init__(
        self, applied: tuple[int, int] | None, *, warmup: int = 1, window: int = 3, drift: float = 0.25
    ) -> None:
        self.applied = applied or (100, 100)
        self.warmup, self.window, self.drift = warmup, window, drift
        self.seen = 0
        self.ratios: list[float] = []
        self.basis: float | None = None  # the ratio of the last suggestion
        self.suggested: tuple[int, int] | None = None

    def observe(self, step: int, generate_s: float, train_s: float) -> tuple[dict[str, float], str | None]:
        """The step's ``mps/*`` metrics and a note when a (new) split is called for, else None."""
        self.seen += 1
        metrics = {"mps/engine_pct": float(self.applied[0]), "mps/trainer_pct": float(self.applied[1])}
        if self.seen <= self.warmup or generate_s <= 0 or train_s <= 0:
            return metrics, None
        self.ratios = [*self.ratios, generate_s / train_s][-self.window :]
        if len(self.ratios) < self.window:
            return metrics, None
        ratio = sorted(self.ratios)[len(self.ratios) // 2]
        metrics["mps/phase_ratio"] = ratio
        drifted = self.basis is not None and abs(ratio / self.basis - 1) > self.drift
        note = None
        if self.basis is None or drifted:
            first = self.basis is None
            self.basis = ratio
            self.suggested = choose_sm_shares(ratio, 1.0)
            note = (
                f"CUDA MPS SM shares after step {step + 1}: generate / train time {ratio:.2f} (median of "
                f"{self.window} steps{'' if first else f', more than {self.drift:.0%} from the last split'}) "
                f"gives engines {self.suggested[0]} %, trainers {self.suggested[1]} % (choose_sm_shares); the "
                f"processes keep {self._applied_words()}, read when each created its CUDA context, and the run "
                f"does not restart them: run.mps_engine_share {self.suggested[0]} applies it to the next run (or "
                "a resume); its effect on the step time is not measured here"
            )
        metrics["mps/drift"] = float(drifted)
        assert self.suggested is not None
        metrics["mps/suggested_engine_pct"] = float(self.suggested[0])
        metrics["mps/suggested_trainer_pct"] = float(self.suggested[1])
        return metrics, note

    def _applied_words(self) -> str:
        if self.applied == (100, 100):
            return "no share (every SM for each)"
        return f"engines {self.applied[0]} %, trainers {self.applied[1]} %"
