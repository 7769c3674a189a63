"""``hybrid``: ``ppo``, ``grpo``, ``reinforce`` (train, or ``--dry-run``) and ``compare`` (engine parity).

A training command's config is built in three layers -- the algorithm's defaults, then ``--config FILE.yaml``,
then the flags given -- and validated before anything starts. Errors print one line naming the flag and the fix
and exit with status 2 (bad input) or 1 (a failure while running).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybrid_core.errors import ConfigError, HybridError

from . import __version__
from .flags import (
    FlagParser,
    add_config_flags,
    check_leftovers,
    field_specs,
    given_config_values,
    given_openrlhf,
    merge_layers,
    translate_openrlhf,
)
from .openrlhf import is_openrlhf_command, line_defaults, without_engines

if TYPE_CHECKING:  # the CLI imports the training package lazily (a fast --help)
    from hybrid_algos.train.config import RLConfig

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM

_ABOUT = {
    "ppo": "PPO with a critic (GAE); OpenRLHF's train_ppo_ray flags work unchanged",
    "grpo": "GRPO: group-normalised rewards, KL as a loss term, no critic",
    "reinforce": "REINFORCE++: KL in the reward, batch-normalised returns, no critic",
}


def build_parser() -> FlagParser:
    """The whole ``hybrid`` command line (one sub-parser per command)."""
    from hybrid_algos.train.config import CONFIGS

    parser = FlagParser(
        prog="hybrid",
        description="Hybrid-engine RL for LLMs: trainers and inference engines share "
        "GPUs. Run `hybrid ppo` for the CPU demo, `hybrid ppo --help` for every flag.",
    )
    parser.add_argument("--version", action="version", version=f"hybrid {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=FlagParser)
    from hybrid_algos.train.config import registry_help

    for name, cls in CONFIGS.items():
        sub = commands.add_parser(
            name,
            help=_ABOUT.get(name, name),
            description=(cls.__doc__ or "").strip(),
            usage=f"hybrid {name} [--config FILE.yaml] [--dry-run] [--FLAG VALUE ...]",
            epilog=registry_help(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_run_flags(sub)
        add_config_flags(sub, cls)
    from .compare import add_compare_flags

    add_compare_flags(commands.add_parser("compare", help="greedy token/log-prob agreement of two engine backends"))
    return parser


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("command")
    group.add_argument("--config", metavar="FILE.yaml", help="settings file (same names as the flags; flags win)")
    group.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="validate, print the placement plan and the residency plan (what stays on each GPU in "
        "each phase, predicted peaks), and exit (no Ray, no GPU)",
    )


def load_config(command: str, argv: Sequence[str]) -> tuple[Any, argparse.Namespace, list[str]]:
    """The validated config of ``hybrid <command> <argv>``, the parsed namespace, and notes on what was inferred."""
    parser = build_parser()
    args, leftovers = parser.parse_known_args([command, *argv])
    return _config_from(parser, args, leftovers, argv)


def _config_from(
    parser: FlagParser, args: argparse.Namespace, leftovers: list[str], argv: Sequence[str] = ()
) -> tuple[Any, argparse.Namespace, list[str]]:
    from hybrid_algos.train.config import CONFIGS
    from hybrid_algos.train.data import resolve_local_paths

    cls = CONFIGS[args.command]
    # a class is hashable; mypy checks its instances' __hash__ (None for an eq dataclass) for the lru_cache key
    bools = {n for n, s in field_specs(cls).items() if s.kind == "bool"}  # type: ignore[arg-type]
    check_leftovers(leftovers, _subparser(parser, args.command), bools)
    given, dotted, notes = _given_settings(args, cls, argv)
    implied, more = _defaults(cls, args.command, given, dotted)
    notes = more + notes  # first: which defaults the line took, and where hybrid differs from OpenRLHF
    values = merge_layers(implied, given)
    for step in (lambda v: without_engines(merge_layers(_field_defaults(cls), v)), resolve_local_paths):
        changes, more = step(values)
        values.update(changes)
        notes += more
    config = cls(**values).record_given(given, openrlhf_line=is_openrlhf_command(given, dotted))
    config.validate()  # a setting given that would do nothing is refused here, or noted (inactive_notes)
    return config, args, notes + config.inactive_notes()


def _given_settings(args: argparse.Namespace, cls: type, argv: Sequence[str]) -> tuple[dict[str, Any], bool, list[str]]:
    """The settings given (config file, then flags; OpenRLHF's flags translated), whether any was spelled the dotted
    OpenRLHF way, and the notes of the translations."""
    notes: list[str] = []
    file_fields: dict[str, Any] = {}
    file_openrlhf: dict[str, Any] = {}
    if args.config:
        from .config_file import load_config_file

        file_values, file_openrlhf = load_config_file(args.config, cls)
        try:
            file_fields, more = translate_openrlhf(file_openrlhf, file_values, cls)
        except ConfigError as e:
            raise ConfigError(e.field, f"{e.problem.rstrip('.')} (key in {args.config!r}).", e.fix) from None
        notes += more
    flag_values = given_config_values(args, cls)
    given, more = translate_openrlhf(given_openrlhf(args, cls), merge_layers(file_fields, flag_values), cls)
    dotted = any("." in name for name in file_openrlhf) or _dotted_openrlhf_flag_used(argv)
    return given, dotted, notes + more


def _defaults(
    cls: type[RLConfig], command: str, given: dict[str, Any], dotted: bool
) -> tuple[dict[str, Any], list[str]]:
    """What is not given: OpenRLHF's defaults for an OpenRLHF command line, the demo's without a model of one's own
    (see hybrid_cli.openrlhf for why), and a note saying which."""
    if is_openrlhf_command(given, dotted):
        line = line_defaults(cls, given, dotted_used=dotted)
        return line.implied, line.notes(cls, command)
    notes: list[str] = []
    implied: dict[str, Any] = {}
    if "pretrain" not in given and "prompt_data" not in given:
        from hybrid_algos.train.config import DEMO_SETTINGS

        from .openrlhf import PLACEMENT_FLAGS

        implied = {k: v for k, v in DEMO_SETTINGS.items() if k not in given}
        from hybrid_algos.train.config import estimator_needs_critic

        critic = estimator_needs_critic(given.get("advantage_estimator", cls.advantage_estimator))
        shown = {k: v for k, v in implied.items() if critic or not k.startswith("critic_")}
        notes.append(
            "no --pretrain: the built-in demo (a tiny model learns the copy task) with its settings: "
            + ", ".join(f"{k}={v}" for k, v in shown.items())
        )
        if PLACEMENT_FLAGS & set(given):
            notes.append(
                "OpenRLHF placement flags on the demo: every other setting keeps hybrid's default "
                "(colocated, the residency planner deciding who sleeps, the built-in engine); "
                "OpenRLHF's defaults apply to OpenRLHF command lines (with --pretrain or dotted flags)."
            )
            implied.update(_demo_fits_the_actor(cls, implied, given))
    return implied, notes


def _demo_fits_the_actor(cls: type, implied: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The demo's per-GPU micro-batch split over more actor GPUs when the user asks for them (same step size)."""
    if "micro_train_batch_size" in given:
        return {}
    merged = {**_field_defaults(cls), **implied, **given}
    world = merged["actor_num_nodes"] * merged["actor_num_gpus_per_node"]
    train, micro = merged["train_batch_size"], merged["micro_train_batch_size"]
    if world > 0 and train % (micro * world) and train % world == 0:
        return {"micro_train_batch_size": train // world}
    return {}


def _field_defaults(cls: type) -> dict[str, Any]:
    return {name: spec.default for name, spec in field_specs(cls).items()}


def _dotted_openrlhf_flag_used(argv: Sequence[str]) -> bool:
    """A flag in OpenRLHF's dotted spelling (``--vllm.num_engines``): a command line of OpenRLHF >= 0.10.2."""
    from .openrlhf_flags import openrlhf_flags

    flags = openrlhf_flags()
    return any(w.startswith("--") and "." in w and w[2:].split("=", 1)[0] in flags for w in argv)


def _subparser(parser: FlagParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def _in_flags(error: BaseException) -> str:
    """An error's text with the settings core and the engines name as ``section.name`` (e.g. a weight-sync mismatch
    raised in a worker, long after the config was checked) written as the flags the user types."""
    from hybrid_algos.train.sections import flag_text

    return flag_text(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybrid`` console script; returns the exit status.

    Every way a command ends is one ``hybrid:`` line on stderr: ``hybrid: error: ...`` for bad input (2),
    ``hybrid: <Error>: ...`` for a failure while running (1), ``hybrid: interrupted`` (Ctrl-C, 130) or
    ``hybrid: terminated`` (SIGTERM, 143) with the checkpoint to continue from. An exception that is not one of
    hybrid's own is a bug: its traceback is printed above that line."""
    global _current_config
    program = argv is None  # the process is this command (the console script): it ends when main returns
    argv = list(sys.argv[1:] if argv is None else argv)
    _current_config = None
    try:
        return _run(argv)
    except ConfigError as e:
        print(f"hybrid: error: {_in_flags(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except HybridError as e:
        print(f"hybrid: {type(e).__name__}: {_in_flags(e)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as e:
        terminated = type(e).__name__ == "Terminated"  # hybrid_algos.train.failures.Terminated: SIGTERM
        what = "terminated (SIGTERM)" if terminated else "interrupted"
        note = getattr(e, "note", "")  # e.g. why the checkpoint on SIGTERM could not be saved
        status = EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
        with _ctrl_c_ends_at_once(status, to_the_end=program):  # Ctrl-C pressed again while the command ends
            print(
                f"hybrid: {what}: the run stopped and its processes were shut down.{' ' + note if note else ''}"
                f"{_resume_line()}",
                file=sys.stderr,
            )
            _finish_ray_shutdown()
        return status
    except Exception as e:  # a bug: show where, then end like every other failure
        import traceback

        traceback.print_exc()
        print(
            f"hybrid: internal error: {type(e).__name__}: {str(e).rstrip('.')}. "
            f"This is a bug in hybrid (or a library it uses); the traceback above says where.{_resume_line()}",
            file=sys.stderr,
        )
        return EXIT_FAILED


def _ctrl_c_ends_at_once(status: int, *, to_the_end: bool = False):
    """While an interrupted command ends, a further Ctrl-C ends it at once with ``status`` (output flushed): not
    with a KeyboardInterrupt traceback out of the line's checkpoint look-up or out of ``ray.shutdown``.
    ``to_the_end``: left so when the process is the command, for its last moments too (the interpreter's exit, Ray's
    at-exit hook); an in-process caller gets its handler back."""
    import contextlib
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()

    def at_once(signum: int, frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed pipe: nothing more to say there
                pass
        os._exit(status)

    @contextlib.contextmanager
    def installed():
        previous = signal.signal(signal.SIGINT, at_once)
        try:
            yield
        finally:
            if not to_the_end:
                signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)

    return installed()


def _finish_ray_shutdown() -> None:
    """Ray's shutdown where a second Ctrl-C cut the run's tear-down short: now, while one more Ctrl-C ends the
    command at once, rather than in Ray's at-exit handler (where a Ctrl-C printed a KeyboardInterrupt traceback)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            ray.shutdown()
        except Exception:  # ending anyway: Ray's processes go with the driver
            logging.getLogger(__name__).debug("ray.shutdown after an interrupt failed", exc_info=True)


#: The config of the training command being run, for the resume hint of an interrupted or failed run.
_current_config: Any = None
_started_at: float = 0.0  # when it started (time.time()): a final model older than that is an earlier run's


def _resume_line() -> str:
    """What the run left: its final model when it was saved, the checkpoint to continue from (or that none was)."""
    if _current_config is None:
        return ""
    import os

    from hybrid_algos.train.checkpoint import CheckpointManager
    from hybrid_algos.train.failures import saved_hint

    return " " + saved_hint(
        CheckpointManager(_current_config.checkpoint_dir), os.path.abspath(_current_config.save_path), since=_started_at
    )


def _run(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, leftovers = parser.parse_known_args(argv)
    if args.command is None:
        check_leftovers(leftovers, parser, set())
        parser.print_help()
        return 0
    if args.command == "compare":
        check_leftovers(leftovers, _subparser(parser, "compare"), set())
        from .compare import run_compare

        return run_compare(args)
    config, args, notes = _config_from(parser, args, leftovers, argv)
    if args.dry_run:
        from .dry_run import dry_run

        return dry_run(config, notes=notes)
    return train_command(config, notes=notes)


def train_command(config: Any, *, notes: Sequence[str] = ()) -> int:
    """Run the training loop with the progress display and the metrics writers."""
    import time

    from .metrics import MetricsLogger
    from .progress import ProgressDisplay

    global _current_config, _started_at
    metrics = MetricsLogger.for_config(config)  # fails here (before Ray) when W&B is asked for and missing
    metrics.check_wandb()  # and here when it has no key or refuses it (no W&B server within reach: offline, noted)
    _current_config, _started_at = config, time.time()
    progress = ProgressDisplay()
    from rich.markup import escape

    # not dim: a note says what was chosen for the user (defaults taken, flags translated)
    for note in [*notes, *metrics.notes()]:
        progress.console.print(f"[yellow]note:[/yellow] {escape(note)}")
    from hybrid_algos.train import TRAINERS  # imported late: the loop pulls in Ray, DeepSpeed and the engines

    try:  # the recipe of the command (hybrid ppo -> train_ppo, ...): the same path as the Python API
        with _sigterm_ends_the_command():  # until the loop's own handler (preemption) takes over, after Ray starts
            TRAINERS[config.algorithm](config, callbacks=[progress, metrics])
    finally:
        metrics.close()
        progress.close()
    return 0


def _sigterm_ends_the_command():
    """SIGTERM before the run's own handler is installed (loading the model, starting Ray) still ends the command
    with its ``hybrid: terminated`` line and 143, not silently."""
    import contextlib
    import signal
    import threading

    from hybrid_algos.train.failures import Terminated

    if threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the tear-down runs undisturbed
        raise Terminated()

    @contextlib.contextmanager
    def installed():
        previous = signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    return installed()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
