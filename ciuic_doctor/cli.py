"""The thin argparse front: `ciuic-doctor <command> ...`.

Each sub-command is a small module in `ciuic_doctor/commands/` with `NAME`, `HELP`, `ORDER`,
`add_arguments(parser)` and `run(args) -> int`. Those modules import only the standard library at
module level; the measuring code (torch, pandas, matplotlib) is imported inside `run`, so
`ciuic-doctor --help` and `ciuic-doctor memwatch` never load torch.

Exit codes: 0 ok, 1 a probe found a failure (wrong results, a dead rank, a missed floor),
2 a usage error (one line on stderr, never a traceback), 130 interrupted (records kept).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from types import ModuleType

from ciuic_doctor import __version__
from ciuic_doctor.errors import ProbeFailed, UserError

PROG = "ciuic-doctor"


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit 2 (README: "one clear line"), never a usage block:
    the line names the command and points at its --help instead."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("argument ") and message.endswith("expected one argument"):
            # `-b -1M`: argparse reads a value that starts with '-' as the next option.
            message += " (a value that starts with '-' is written --option=VALUE)"
        line = " ".join(f"{self.prog}: error: {message}".split())  # no newline inside the one line
        self.exit(2, f"{line} (see {self.prog} --help)\n")


def _command_modules() -> list[ModuleType]:
    import ciuic_doctor.commands as package

    modules = [
        importlib.import_module(f"{package.__name__}.{info.name}")
        for info in pkgutil.iter_modules(package.__path__)
        if not info.name.startswith("_")
    ]
    return sorted(modules, key=lambda m: (m.ORDER, m.NAME))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Measure a distributed PyTorch job on its own machines, judge the measurements, and "
            "recommend settings with the evidence behind each one."
        ),
        epilog="Start with `ciuic-doctor checkup`; every command has its own --help.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_Parser)
    for module in _command_modules():
        command = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.__doc__,
            # Command docstrings hold example command lines: keep their line breaks.
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = _run_command(argv)
    # A rank of comm-bench, job or checkpoint-check ends here, skipping interpreter teardown (see why in
    # exit_rank_process); launch imports no torch, so --help stays light.
    from ciuic_doctor.launch import exit_rank_process

    exit_rank_process(code)
    return code


def console_main() -> None:
    """The `ciuic-doctor` console script and `python -m ciuic_doctor`: main, then the process's end.

    main returns its code (tests and other Python call it in-process); a process of its own ends
    through exit_command_process, which skips the interpreter teardown that native thread pools can
    abort in after the command finished.
    """
    from ciuic_doctor.launch import exit_command_process

    code = main()
    exit_command_process(code)
    raise SystemExit(code)


def _prepare_out(args: argparse.Namespace) -> None:
    """Check `--out` before anything runs, so a refused folder costs nothing: one line, exit 2.

    With --force the folder is taken now and stamped as a run, so the ranks and probes that create it
    again later (they never see --force) find a run directory.
    """
    out = getattr(args, "out", None)
    if not out or not hasattr(args, "force"):
        return
    from pathlib import Path

    from ciuic_doctor.rundir.store import RunDir

    if Path(out).exists() or args.force:  # a missing folder is made by the command, once it runs
        RunDir.create(out, force=args.force, force_option=True)


def _run_command(argv: list[str] | None) -> int:
    from ciuic_doctor.launch import die_with_launcher

    die_with_launcher()  # a rank of our launcher ends with it, even when it is killed with -9
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        _prepare_out(args)
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ProbeFailed as exc:
        print(f"{PROG} {args.command}: FAILED: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"\n{PROG} {args.command}: interrupted; every record measured so far is kept.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `ciuic-doctor ... | head`
        return 0


if __name__ == "__main__":
    console_main()
