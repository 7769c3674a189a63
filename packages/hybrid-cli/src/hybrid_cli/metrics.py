"""Metrics writers: ``<save_path>/metrics.jsonl`` always, TensorBoard when installed, Weights & Biases on request.

``--use_tensorboard`` is on by default but the tensorboard package is an extra (``hybrid-cli[tensorboard]``): when
it is missing, the run says so at start (a note naming the fix) and writes metrics.jsonl only -- never silently.

One JSON object per step (the step's metrics plus ``wall_time``); non-finite numbers are written as ``null`` so
every JSON reader accepts the file. A resumed run appends to the file, after cutting it back to the steps before
its checkpoint (the steps after it are done again: they would be there twice; TensorBoard is told to purge them
too); a new run starts it afresh. The end-of-run summary goes to ``summary.json`` beside it. No credential is
written (:mod:`hybrid_algos.train.redact`): W&B gets the config and the command line without its API key.

``--use_wandb`` is checked before Ray starts (:meth:`MetricsLogger.check_wandb`): W&B itself finds a missing or
refused key only once the run has started, a minute in, and without its server it waits 90 s to fail. No key, or
one the server refuses: the command stops, naming the fix. No server within reach (a cluster without internet):
the run logs offline into its folder, and says how to upload that later.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import IO, Any

from hybrid_core.errors import ConfigError

log = logging.getLogger(__name__)
WANDB_FIX = "pip install wandb (or pip install 'hybrid-cli[wandb]'), or drop --use_wandb."
WANDB_LOGIN_FIX = (
    "Run `wandb login` (or set WANDB_API_KEY, or give the key: --use_wandb KEY); or log offline "
    "with WANDB_MODE=offline (`wandb sync` uploads it later), or drop --use_wandb."
)
#: How long the W&B server has to answer before the run logs offline.
WANDB_REACH_S = 5.0


class MetricsLogger:
    """A training callback writing every step's metrics to JSONL (+ TensorBoard, + W&B)."""

    def __init__(
        self,
        run_dir: str | None = None,
        *,
        tensorboard: bool = True,
        wandb_key: str | None = None,
        wandb_project: str = "hybrid",
        wandb_run_name: str | None = None,
        config: dict | None = None,
    ):
        self.run_dir = run_dir
        self.tensorboard = tensorboard
        self.wandb_key = wandb_key
        self.wandb_project = wandb_project
        self.wandb_run_name = wandb_run_name
        self.config = config or {}
        self._jsonl: IO[str] | None = None
        self._tb: Any = None  # a SummaryWriter
        self._wandb = None
        self.wandb_mode: str | None = None  # "offline" when check_wandb found no server within reach
        self._wandb_checked = False  # check_wandb logged in (verified): on_start does not again
        self._notes: list[str] = []
        if wandb_key:
            self._wandb_module()  # fail now, before Ray or a GPU is taken

    @classmethod
    def for_config(cls, config: Any) -> MetricsLogger:
        from hybrid_algos.train.redact import hide_in_argv, redact, secrets_of

        secrets = secrets_of(config)
        if secrets:  # W&B (and any library) records sys.argv in the run folder: the key is taken out of it
            hide_in_argv(sys.argv)
        return cls(
            config.save_path,
            tensorboard=config.use_tensorboard,
            wandb_key=config.use_wandb,
            wandb_project=config.wandb_project,
            wandb_run_name=config.wandb_run_name,
            config=redact(_plain(config.to_dict()), secrets),
        )

    def notes(self) -> list[str]:
        """What the user should know about where metrics go (shown before the run starts)."""
        if self.tensorboard and not tensorboard_installed():
            return [
                "tensorboard is not installed, so metrics go to metrics.jsonl only "
                "(pip install tensorboard, or 'hybrid-cli[tensorboard]'; --no_use_tensorboard hides this note)",
                *self._notes,
            ]
        return list(self._notes)

    def check_wandb(self) -> None:
        """Before Ray starts: log in to W&B and have its server verify the key (a :class:`ConfigError` naming the
        fix when there is no key or the server refuses it); no server within reach: log offline, with a note.
        Nothing to do without --use_wandb, or with W&B's own offline / disabled mode (WANDB_MODE)."""
        if not self.wandb_key or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
            return
        wandb = self._wandb_module()
        settings = getattr(wandb.setup(), "settings", None)  # W&B's own: WANDB_BASE_URL, its settings files
        if str(getattr(settings, "mode", "online")) in ("offline", "disabled", "dryrun"):
            return
        url = str(getattr(settings, "base_url", None) or os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
        why = unreachable(url, WANDB_REACH_S)
        if why is not None:
            self.wandb_mode = "offline"
            where = os.path.join(self.run_dir or ".", "wandb")
            self._notes.append(
                f"W&B: nothing answers at {url} ({why}), so the run logs offline into {where} "
                f"(upload it later: wandb sync {os.path.join(where, 'offline-run-*')}; the API key "
                "is not checked)"
            )
            return
        key = self.wandb_key if self._explicit_key() else None  # None: W&B finds it (WANDB_API_KEY, netrc)
        try:
            wandb.login(key=key, relogin=key is not None, verify=True)
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if key:
                text = text.replace(key, "<redacted>")
            what = (
                "no W&B API key is configured here"
                if isinstance(e, wandb.errors.UsageError) and key is None
                else f"W&B ({url}) refused the API key"
            )
            raise ConfigError("use_wandb", f"{what}: {text.rstrip('.')}.", WANDB_LOGIN_FIX) from None
        self._wandb_checked = True

    def _explicit_key(self) -> bool:
        return bool(self.wandb_key and self.wandb_key.lower() not in ("true", "1"))  # OpenRLHF passes the key itself

    @property
    def path(self) -> str | None:
        return os.path.join(self.run_dir, "metrics.jsonl") if self.run_dir else None

    # ---- callback ----------------------------------------------------------------------------------------------
    def on_start(self, info: dict[str, Any]) -> None:
        run_dir = self.run_dir = os.path.abspath(info.get("run_dir") or self.run_dir or ".")
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "metrics.jsonl")  # self.path, now that the run folder is known
        start_step = int(info.get("start_step") or 0)
        resumed = start_step > 0
        if resumed:
            from hybrid_algos.train.resume import drop_steps_from

            drop_steps_from(path, start_step)  # the steps after the checkpoint are done again
        # open for the run's life (closed by on_end), not a `with` block
        self._jsonl = open(path, "a" if resumed else "w", encoding="utf-8")  # noqa: SIM115
        if self.tensorboard:
            self._tb = _tensorboard_writer(
                os.path.join(self.run_dir, "tensorboard"), purge_step=start_step if resumed else None
            )
        if self.wandb_key:
            wandb = self._wandb_module()
            if self._explicit_key() and not self._wandb_checked and self.wandb_mode is None:
                wandb.login(key=self.wandb_key, relogin=True)
            mode = {"mode": self.wandb_mode} if self.wandb_mode else {}  # offline: check_wandb found no server
            self._wandb = wandb.init(
                project=self.wandb_project,
                name=self.wandb_run_name,
                config=self.config,
                dir=self.run_dir,
                resume="allow" if resumed else None,
                **mode,
            )

    def on_step(self, metrics: dict[str, Any]) -> None:
        if self._jsonl is None:
            self.on_start({})
        assert self._jsonl is not None  # on_start opened it
        step = int(metrics.get("step", 0))
        record = {k: _finite(v) for k, v in metrics.items()}
        record["wall_time"] = time.time()
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        numbers = {k: float(v) for k, v in metrics.items() if _is_number(v) and k != "step"}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def on_end(self, summary: dict[str, Any]) -> None:
        if self.run_dir:
            from hybrid_algos.train.redact import redact

            with open(os.path.join(self.run_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(redact(_plain(summary)), f, indent=2)
        self.close()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _wandb_module(self):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "use_wandb", "logging to Weights & Biases needs the wandb package, which is not installed.", WANDB_FIX
            ) from None
        return wandb


def unreachable(url: str, timeout_s: float) -> str | None:
    """Why nothing answers at ``url`` within ``timeout_s`` (through the proxies the environment names, as W&B goes);
    None when something does -- any HTTP status, 401 or 404 included."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        return str(e.reason)
    except Exception as e:  # a timeout, a connection reset, a URL that is none
        return f"{type(e).__name__}: {e}"
    return None


def tensorboard_installed() -> bool:
    try:
        import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
    except ImportError:
        return False
    return True


def _tensorboard_writer(log_dir: str, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        log.warning("tensorboard is not installed: metrics go to metrics.jsonl only (pip install tensorboard)")
        return None
    # purge_step: TensorBoard discards the events of earlier files at that step and later (a resume does them again)
    return SummaryWriter(log_dir=log_dir, purge_step=purge_step)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        return _finite(value.item())
    return value


def _plain(value: Any) -> Any:
    """A JSON-ready copy (tuples to lists, unknown objects to their repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return _finite(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return repr(value)
