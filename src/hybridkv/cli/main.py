"""The ``hybridkv`` command: one entry point, one module per subcommand, imported lazily.

User errors (any :class:`hybridkv.errors.HybridKVError`) print one line to stderr and exit 2;
no traceback.  ``--help`` imports no subcommand module, so it is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn, Protocol

__all__ = ["main"]

#: subcommand -> (module, one-line help).  Each module defines ``add_arguments(parser)`` and
#: ``run(args) -> int``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("hybridkv.cli.plan_cmd", "capacity plan for a model and a memory budget"),
    "models": ("hybridkv.cli.models_cmd", "list the built-in model catalog"),
    "simulate": ("hybridkv.cli.simulate_cmd", "replay a workload through the cache manager"),
    "run": ("hybridkv.cli.run_cmd", "run a model through the paged cache (and check it)"),
}


class _Command(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(name: str) -> _Command:
    module: _Command = importlib.import_module(SUBCOMMANDS[name][0])
    return module


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error style: one line on stderr, exit 2, no usage block."""

    #: The command line being parsed (for the hint on a value that starts with '-').
    argv: Sequence[str] = ()

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            # argparse reads "-1GiB" as an option, not as the value it is
            flag = message.removeprefix("argument ").split(":", 1)[0].split("/", 1)[0]
            argv = list(self.argv)
            after = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
            value = next((v for v in after if v.startswith("-")), None)
            if value is not None and value not in self._option_string_actions:
                message += f" ({value!r} reads as an option; write {flag}={value})"
        elif "invalid int value" in message:
            message += " (give a whole number)"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    _Parser.argv = tuple(argv)  # the subcommands' parsers are _Parsers too
    parser = _Parser(
        prog="hybridkv",
        description="KV-cache planning, management and layout for hybrid-attention LLMs.",
    )
    from hybridkv import __version__

    version = f"hybridkv {__version__}"
    if "--version" in argv:  # which build of the bookkeeping (imported only when asked)
        from hybridkv.cache import compiled

        version += " (compiled bookkeeping)" if compiled() else " (pure Python)"
    parser.add_argument("--version", action="version", version=version)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported, so `hybridkv --help` stays instant.
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    from hybridkv.cli.common import HelpFormatter

    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == chosen:
            _load(name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failure, 2 bad input)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args, extra = parser.parse_known_args(args_list)
    if extra:
        prog = "hybridkv" if args.command is None else f"hybridkv {args.command}"
        print(
            f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)",
            file=sys.stderr,
        )
        return 2
    if args.command is None:
        parser.print_help()
        return 2
    from hybridkv.errors import HybridKVError

    try:
        return _load(args.command).run(args)
    except HybridKVError as exc:
        from hybridkv.cli.common import with_flag_names

        print(f"hybridkv {args.command}: error: {with_flag_names(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hybridkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        # what the run asked for is more than this host holds (a budget of exabytes, a
        # million long synthetic requests): say so, not a traceback through the allocator
        print(
            f"hybridkv {args.command}: error: out of host memory; give smaller sizes or "
            "fewer requests",
            file=sys.stderr,
        )
        return 1
    except BrokenPipeError:
        # The reader went away (``hybridkv plan ... | head``): not an error of ours.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
