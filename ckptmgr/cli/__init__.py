"""The ``ckptmgr`` command: manage checkpoints outside training.

    ckptmgr ls ROOT                         steps, tier, size, commit time, protected, metadata
    ckptmgr inspect ROOT [STEP]             the state tree (--tensors: every tensor; --all: no summaries)
    ckptmgr verify ROOT [STEP]              read every byte, check every checksum
    ckptmgr prune ROOT --keep-latest N ...  apply a retention policy (--dry-run first)
    ckptmgr flush ROOT [--drop]             write the step this node's local tier holds only (or drop it)
    ckptmgr export ROOT STEP --to DIR       model.safetensors (+ index) and state.json, no ckptmgr needed
    ckptmgr import FILE ROOT [--step N]     a torch.save / Lightning .ckpt / safetensors file

ROOT is a path or an fsspec URL (``s3://bucket/prefix``); for ``ls``, ``inspect`` and ``verify``
it may also be a directory of torch checkpoint files (Lightning's ModelCheckpoint directory,
``inspect DIR FILE|STEP`` then names the file) or one such file, and for ``ls`` and ``verify`` the
integrations' ``checkpoint-N``/``checkpoint_N`` directories (checked against their ``ckptmgr.json``)
or their parent; ``--storage-options JSON`` (or the
environment variable ``CKPTMGR_STORAGE_OPTIONS``) passes credentials and endpoints. STEP is a
step number or ``latest``. ``--json`` (before or after the command) prints one JSON document
for scripts (an error as well); progress bars show on a terminal only. ``ls``, ``inspect``, ``verify`` and
``export`` only read: they create nothing under ROOT and work on read-only roots. A damaged
step is reported with its error; ``ls`` and ``verify`` still list and check the others.
``verify`` fails (exit 3) where there is no checkpoint to check; ``prune`` refuses a
``--keep-best`` metric that no step has (``--force`` prunes anyway).

Exit codes: 0 success; 1 corruption found (a damaged step or manifest, a checksum failing);
2 bad arguments or input; 3 no such root, step or file; 4 the step or export destination
exists; 5 storage error; 70 internal error (a bug; CKPTMGR_DEBUG=1 shows the
traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .. import __version__
from ..errors import CkptError
from ._exit import EXIT, CorruptFound, exit_code

__all__ = ["EXIT", "main"]

# Each command's function as "module:name", imported only when that command runs: --help,
# --version and a bad argument answer without importing torch or the command modules; ls,
# inspect, verify and prune of a ckptmgr root import no torch either (tests/test_cli_promises.py).
_COMMANDS = {
    "ls": "_browse:cmd_ls",
    "inspect": "_browse:cmd_inspect",
    "verify": "_maintain:cmd_verify",
    "prune": "_maintain:cmd_prune",
    "flush": "_maintain:cmd_flush",
    "export": "_transfer:cmd_export",
    "import": "_transfer:cmd_import",
}


class _UsageError(Exception):
    """A bad command line (argparse's error), raised so that ``main`` can report it as JSON too."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse prints and exits; main reports it instead
        raise _UsageError(self, message)


def _print_error(command: str | None, message: str, code: int, kind: str, as_json: bool) -> None:
    """An error on stderr, and with ``--json`` also as one JSON document on stdout."""
    print(f"ckptmgr{' ' + command if command else ''}: error: {message}", file=sys.stderr)
    if as_json:
        json.dump({"ok": False, "command": command, "error": {"type": kind, "message": message, "exit_code": code}},
                  sys.stdout, indent=1, ensure_ascii=False)
        sys.stdout.write("\n")


def _common(default: object) -> _Parser:
    """The options every command takes, before or after its name. After it, their default is
    ``SUPPRESS``, so that a value given before the command is not reset to the default."""
    common = _Parser(add_help=False)
    unset = default is argparse.SUPPRESS
    common.add_argument("--json", action="store_true", default=default if unset else False,
                        help="print one JSON document (for scripts)")
    common.add_argument("-q", "--quiet", action="store_true", default=default if unset else False,
                        help="no progress bars")
    common.add_argument("--storage-options", metavar="JSON", default=default if unset else None,
                        help="fsspec storage options for URL roots (default: $CKPTMGR_STORAGE_OPTIONS)")
    return common


def _parser() -> argparse.ArgumentParser:
    common = _common(argparse.SUPPRESS)
    p = _Parser(prog="ckptmgr", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[-1], parents=[_common(None)],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ckptmgr {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        c: argparse.ArgumentParser = sub.add_parser(name, parents=[common], help=help_, description=help_)
        return c

    c = add("ls", "list committed checkpoints")
    c.add_argument("root")
    c.add_argument("--local-dir", default="/dev/shm",
                   help="where the local tier lives (default /dev/shm; '' to skip it)")
    c = add("inspect", "show the state tree of a step")
    c.add_argument("root")
    c.add_argument("step", nargs="?", help="step number or 'latest' (default)")
    c.add_argument("--tensors", action="store_true", help="also list every tensor with its file")
    c.add_argument("--all", action="store_true",
                   help="show every item of long lists and tuples (default: the first few and a count)")
    c = add("verify", "check every file of every (or one) step against its checksums")
    c.add_argument("root")
    c.add_argument("step", nargs="?", help="one step (default: all)")
    c.add_argument("--threads", type=int, default=8, help="parallel reads (default 8)")
    c.add_argument("--local-dir", default="/dev/shm",
                   help="where the local tier lives: its steps not yet in the root are listed, not read "
                        "(default /dev/shm; '' to skip it)")
    c = add("prune", "delete the steps a retention policy does not keep")
    c.add_argument("root")
    c.add_argument("--keep-latest", type=int, metavar="N", help="keep the newest N steps")
    c.add_argument("--keep-every", type=int, metavar="K", help="keep one step per K steps (archive)")
    c.add_argument("--keep-every-seconds", type=float, metavar="S", help="keep one step per S seconds")
    c.add_argument("--keep-best", action="append", metavar="METRIC:N[:min|max]",
                   help="keep the N best steps by a metadata metric (repeatable)")
    c.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    c.add_argument("--force", action="store_true",
                   help="prune even when no step has a --keep-best metric (it then keeps no step by it)")
    c = add("flush", "write the newest step this node's local tier holds only to ROOT (or --drop it)")
    c.add_argument("root")
    c.add_argument("--local-dir", default="/dev/shm", help="where the local tier lives (default /dev/shm)")
    c.add_argument("--drop", action="store_true",
                   help="delete this node's local-tier copies of ROOT's steps instead, writing nothing")
    c = add("export", "write a step as plain safetensors files in Hugging Face's names, + JSON")
    c.add_argument("root")
    c.add_argument("step", help="step number or 'latest'")
    c.add_argument("--to", required=True, metavar="DIR", help="a new (or empty) local directory")
    c.add_argument("--only", metavar="PREFIX", help="only tensors whose name starts with PREFIX (e.g. 'model/'), "
                   "which is stripped from the exported names")
    c = add("import", "store a torch.save / Lightning / safetensors file as a checkpoint")
    c.add_argument("file")
    c.add_argument("root")
    c.add_argument("--step", type=int, help="the step to store it as (default for Lightning: its global_step)")
    c.add_argument("--safe-global", action="append", metavar="MODULE.NAME",
                   help="allow this class in weights_only loading (repeatable; only for files you trust)")
    c.add_argument("--allow-pickle", action="store_true",
                   help="store values ckptmgr cannot store natively with pickle (readers must allow it too)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckptmgr`` command line; return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except _UsageError as bad:
        bad.parser.print_usage(sys.stderr)
        _print_error(None, bad.message, EXIT["usage"], "UsageError", "--json" in argv)
        return EXIT["usage"]
    logging.basicConfig(level=logging.WARNING, format="ckptmgr: %(levelname)s: %(message)s")
    as_json = bool(args.json)
    ctx = None
    try:
        from ._context import Ctx

        module, name = _COMMANDS[args.command].split(":")
        fn = getattr(importlib.import_module(f".{module}", __name__), name)
        ctx = Ctx(args)
        return int(fn(ctx, args))
    except CorruptFound as found:  # reported by the command (its JSON document says so)
        return found.code
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT["ok"]
    except KeyboardInterrupt:
        _print_error(args.command, "interrupted", EXIT["interrupted"], "KeyboardInterrupt", as_json)
        return EXIT["interrupted"]
    except (CkptError, OSError) as exc:
        code = exit_code(exc)
        _print_error(args.command, str(exc), code, type(exc).__name__, as_json)
        return code
    except Exception as exc:  # never a traceback for a user: say what failed, and how to see more
        if os.environ.get("CKPTMGR_DEBUG"):
            raise
        _print_error(args.command, f"internal error: {type(exc).__name__}: {exc} (a bug in ckptmgr: please report "
                     "it; CKPTMGR_DEBUG=1 prints the traceback)", EXIT["internal"], type(exc).__name__, as_json)
        return EXIT["internal"]
    finally:
        if ctx is not None:
            ctx.close()
