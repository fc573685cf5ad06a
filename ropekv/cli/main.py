"""``ropekv``: a thin command line over the library.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``.
Every :class:`ropekv.errors.RopeKVError` becomes one line on stderr and its exit code (docs/errors.md);
a traceback is printed only with ``--debug``. Exit codes: 0 ok, 1 parity does not hold, 2 bad input,
usage or a broken adapter, 3 a contract refused at a boundary, 4 a transport failure, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from ..argtypes import RaisingParser
from ..errors import RopeKVError

SUBCOMMANDS = ("check", "run", "handoff", "bench", "models", "replay")


def build_parser() -> argparse.ArgumentParser:
    parser = RaisingParser(
        prog="ropekv",
        name_in_errors=False,  # main prints "ropekv: error: " before every message
        description="Make a KV cache's RoPE convention explicit and prove cached decoding matches a full forward pass.",
        epilog="exit codes: 0 ok; 1 parity does not hold; 2 bad input, usage or a broken adapter; "
        "3 a contract refused at a boundary; 4 a transport failure; 130 interrupted (Ctrl-C). "
        "See docs/errors.md.",
    )
    parser.add_argument("--debug", action="store_true", help="print a traceback on errors")
    parser.add_argument(
        "--version", action="version", version=f"ropekv {_version()}", help="print ropekv's version and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=RaisingParser)
    for name in SUBCOMMANDS:
        module = _module(name)
        if module is not None:
            module.add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ropekv")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _module(name: str):
    try:
        return importlib.import_module(f"ropekv.cli.{name}_cmd")
    except ModuleNotFoundError as exc:
        if exc.name == f"ropekv.cli.{name}_cmd":
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is accepted anywhere on the line (before or after the subcommand), not only where the
    # top-level parser would see it; it must also work when parsing itself fails.
    debug = "--debug" in argv
    argv = (["--debug"] if debug else []) + [a for a in argv if a != "--debug"]
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.command_line = ["ropekv", *argv]  # for reports' provenance
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        from ..models.embedded import fold_model_name

        fold_model_name(args)
        try:
            return int(args.handler(args))
        except SystemExit as exc:
            # Library or engine code ending the process from inside a subcommand has printed no verdict:
            # exit 0 is only ever a subcommand's own return (a verdict of parity, or a listing).
            raise RopeKVError(
                f"{args.command} stopped without a verdict: sys.exit({_safe(exc.code)!s}) was called"
            ) from exc
    except RopeKVError as exc:
        if debug:
            traceback.print_exc()
        message = " ".join(_safe(exc).splitlines()) or type(exc).__name__  # always exactly one line
        print(f"ropekv: error: {message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ropekv: interrupted", file=sys.stderr)
        return 130


def _safe(value: object) -> str:
    """``str(value)``, or its type's name where ``str()`` itself raises."""
    try:
        return str(value)
    except Exception:
        return type(value).__name__


if __name__ == "__main__":
    sys.exit(main())
