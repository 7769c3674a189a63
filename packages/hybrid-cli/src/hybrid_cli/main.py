"""``hybrid``: ``ppo``, ``grpo``, ``reinforce`` (train, or ``--dry-run``) and ``compare`` (engine parity).

A training command's config is built in three layers -- the algorithm's defaults, then ``--config FILE.yaml``,
then the flags given -- and validated before anything starts. Errors print one line naming the flag and the fix
and exit with status 2 (bad input) or 1 (a failure while running).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

from hybrid_core.errors import ConfigError, HybridError

from . import __version__
from .flags import FlagParser, add_config_flags, check_leftovers, field_specs, given_config_values, merge_layers
from .openrlhf import openrlhf_defaults

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

    parser = FlagParser(prog="hybrid", description="Hybrid-engine RL for LLMs: trainers and inference engines share "
                        "GPUs. Run `hybrid ppo` for the CPU demo, `hybrid ppo --help` for every flag.")
    parser.add_argument("--version", action="version", version=f"hybrid {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=FlagParser)
    for name, cls in CONFIGS.items():
        sub = commands.add_parser(name, help=_ABOUT.get(name, name), description=(cls.__doc__ or "").strip(),
                                  usage=f"hybrid {name} [--config FILE.yaml] [--dry-run] [--FLAG VALUE ...]")
        _add_run_flags(sub)
        add_config_flags(sub, cls)
    from .compare import add_compare_flags

    add_compare_flags(commands.add_parser("compare", help="greedy token/log-prob agreement of two engine backends"))
    return parser


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("command")
    group.add_argument("--config", metavar="FILE.yaml", help="settings file (same names as the flags; flags win)")
    group.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                       help="validate, print the placement plan and the GPU-memory budget, and exit (no Ray, no GPU)")
    group.add_argument("--gpu_memory_gb", type=float, metavar="GIB",
                       help="GPU memory (GiB) for the --dry-run budget (default: the local GPU's, else 80)")


def load_config(command: str, argv: Sequence[str]) -> tuple[Any, argparse.Namespace, list[str]]:
    """The validated config of ``hybrid <command> <argv>``, the parsed namespace, and notes on what was inferred."""
    parser = build_parser()
    args, leftovers = parser.parse_known_args([command, *argv])
    return _config_from(parser, args, leftovers)


def _config_from(parser: FlagParser, args: argparse.Namespace, leftovers: list[str]
                 ) -> tuple[Any, argparse.Namespace, list[str]]:
    from hybrid_algos.train.config import CONFIGS

    cls = CONFIGS[args.command]
    check_leftovers(leftovers, _subparser(parser, args.command),
                    {n for n, s in field_specs(cls).items() if s.kind == "bool"})
    file_values: dict[str, Any] = {}
    if args.config:
        from .config_file import load_config_file

        file_values = load_config_file(args.config, cls)
    flag_values = given_config_values(args, cls)
    given = merge_layers(file_values, flag_values)
    implied = openrlhf_defaults(given)
    notes = []
    if implied:
        notes.append("OpenRLHF-style placement given, so OpenRLHF's defaults apply to what was not: "
                     + ", ".join(f"{k}={v}" for k, v in implied.items()))
    elif "pretrain" not in given and "prompt_data" not in given:
        from hybrid_algos.train.config import DEMO_SETTINGS

        implied = {k: v for k, v in DEMO_SETTINGS.items() if k not in given}
        critic = given.get("advantage_estimator", cls.advantage_estimator) == "gae"  # only GAE trains a critic
        shown = {k: v for k, v in implied.items() if critic or not k.startswith("critic_")}
        notes.append("no --pretrain: the built-in demo (a tiny model learns the copy task) with its settings: "
                     + ", ".join(f"{k}={v}" for k, v in shown.items()))
    config = cls(**merge_layers(implied, given))
    return config.validate(), args, notes


def _subparser(parser: FlagParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybrid`` console script; returns the exit status.

    Every way a command ends is one ``hybrid:`` line on stderr: ``hybrid: error: ...`` for bad input (2),
    ``hybrid: <Error>: ...`` for a failure while running (1), ``hybrid: interrupted`` (Ctrl-C, 130) or
    ``hybrid: terminated`` (SIGTERM, 143) with the checkpoint to continue from. An exception that is not one of
    hybrid's own is a bug: its traceback is printed above that line."""
    global _current_config
    argv = list(sys.argv[1:] if argv is None else argv)
    _current_config = None
    try:
        return _run(argv)
    except ConfigError as e:
        print(f"hybrid: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except HybridError as e:
        print(f"hybrid: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as e:
        terminated = type(e).__name__ == "Terminated"  # hybrid_algos.train.failures.Terminated: SIGTERM
        what = "terminated (SIGTERM)" if terminated else "interrupted"
        print(f"hybrid: {what}: the run stopped and its processes were shut down.{_resume_line()}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except Exception as e:  # a bug: show where, then end like every other failure
        import traceback

        traceback.print_exc()
        print(f"hybrid: internal error: {type(e).__name__}: {str(e).rstrip('.')}. This is a bug in hybrid (or a library it uses); "
              f"the traceback above says where.{_resume_line()}", file=sys.stderr)
        return EXIT_FAILED


#: The config of the training command being run, for the resume hint of an interrupted or failed run.
_current_config: Any = None


def _resume_line() -> str:
    if _current_config is None:
        return ""
    from hybrid_algos.train.checkpoint import CheckpointManager
    from hybrid_algos.train.failures import resume_hint

    return " " + resume_hint(CheckpointManager(_current_config.checkpoint_dir))


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
    config, args, notes = _config_from(parser, args, leftovers)
    if args.dry_run:
        from .dry_run import dry_run

        return dry_run(config, gpu_memory_gb=args.gpu_memory_gb, notes=notes)
    return train_command(config, notes=notes)


def train_command(config: Any, *, notes: Sequence[str] = ()) -> int:
    """Run the training loop with the progress display and the metrics writers."""
    from .metrics import MetricsLogger
    from .progress import ProgressDisplay

    global _current_config
    metrics = MetricsLogger.for_config(config)  # fails here (before Ray) when W&B is asked for and missing
    _current_config = config
    progress = ProgressDisplay()
    for note in [*notes, *metrics.notes()]:
        progress.console.print(f"[dim]note: {note}[/dim]")
    from hybrid_algos.train import train  # imported late: the loop pulls in Ray, DeepSpeed and the engines

    try:
        train(config, callbacks=[progress, metrics])
    finally:
        metrics.close()
        progress.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
