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
``inspect DIR FILE`` then names the file) or one such file; ``--storage-options JSON`` (or the
environment variable ``CKPTMGR_STORAGE_OPTIONS``) passes credentials and endpoints. STEP is a
step number or ``latest``. ``--json`` (before or after the command) prints one JSON document
for scripts; progress bars show on a terminal only. ``ls``, ``inspect``, ``verify`` and
``export`` only read: they create nothing under ROOT and work on read-only roots. A damaged
step is reported with its error; ``ls`` and ``verify`` still list and check the others.

Exit codes: 0 success; 1 corruption found (a damaged step or manifest, a checksum failing);
2 bad arguments or input; 3 no such root, step or file; 4 the step or export destination
exists; 5 storage error; 70 internal error (a bug; CKPTMGR_DEBUG=1 shows the
traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from .. import __version__
from ..errors import CkptError
from ._browse import cmd_inspect, cmd_ls
from ._context import EXIT, CorruptFound, Ctx, exit_code
from ._maintain import add_flush, cmd_prune, cmd_verify
from ._transfer import cmd_export, cmd_import

__all__ = ["EXIT", "main"]

Command = Callable[[Ctx, argparse.Namespace], int]


def _common(default: object) -> argparse.ArgumentParser:
    """The options every command takes, before or after its name. After it, their default is
    ``SUPPRESS``, so that a value given before the command is not reset to the default."""
    common = argparse.ArgumentParser(add_help=False)
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
    p = argparse.ArgumentParser(prog="ckptmgr", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n")[-1], parents=[_common(None)],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ckptmgr {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Command, help_: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, parents=[common], help=help_, description=help_)
        c.set_defaults(fn=fn)
        return c

    c = add("ls", cmd_ls, "list committed checkpoints")
    c.add_argument("root")
    c.add_argument("--local-dir", default="/dev/shm",
                   help="where the local tier lives (default /dev/shm; '' to skip it)")
    c = add("inspect", cmd_inspect, "show the state tree of a step")
    c.add_argument("root")
    c.add_argument("step", nargs="?", help="step number or 'latest' (default)")
    c.add_argument("--tensors", action="store_true", help="also list every tensor with its file")
    c.add_argument("--all", action="store_true",
                   help="show every item of long lists and tuples (default: the first few and a count)")
    c = add("verify", cmd_verify, "check every file of every (or one) step against its checksums")
    c.add_argument("root")
    c.add_argument("step", nargs="?", help="one step (default: all)")
    c.add_argument("--threads", type=int, default=8, help="parallel reads (default 8)")
    c.add_argument("--local-dir", default="/dev/shm",
                   help="where the local tier lives: its steps not yet in the root are listed, not read "
                        "(default /dev/shm; '' to skip it)")
    c = add("prune", cmd_prune, "delete the steps a retention policy does not keep")
    c.add_argument("root")
    c.add_argument("--keep-latest", type=int, metavar="N", help="keep the newest N steps")
    c.add_argument("--keep-every", type=int, metavar="K", help="keep one step per K steps (archive)")
    c.add_argument("--keep-every-seconds", type=float, metavar="S", help="keep one step per S seconds")
    c.add_argument("--keep-best", action="append", metavar="METRIC:N[:min|max]",
                   help="keep the N best steps by a metadata metric (repeatable)")
    c.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    add_flush(add)
    c = add("export", cmd_export, "write a step as plain safetensors files in Hugging Face's names, + JSON")
    c.add_argument("root")
    c.add_argument("step", help="step number or 'latest'")
    c.add_argument("--to", required=True, metavar="DIR", help="a new (or empty) local directory")
    c.add_argument("--only", metavar="PREFIX", help="only tensors whose name starts with PREFIX (e.g. 'model/'), "
                   "which is stripped from the exported names")
    c = add("import", cmd_import, "store a torch.save / Lightning / safetensors file as a checkpoint")
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
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="ckptmgr: %(levelname)s: %(message)s")
    ctx = Ctx(args)
    try:
        return int(args.fn(ctx, args))
    except CorruptFound as found:
        return found.code
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT["ok"]
    except KeyboardInterrupt:
        print("ckptmgr: interrupted", file=sys.stderr)
        return EXIT["interrupted"]
    except (CkptError, OSError) as exc:
        print(f"ckptmgr {args.command}: error: {exc}", file=sys.stderr)
        return exit_code(exc)
    except Exception as exc:  # never a traceback for a user: say what failed, and how to see more
        if os.environ.get("CKPTMGR_DEBUG"):
            raise
        print(f"ckptmgr {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(a bug in ckptmgr: please report it; CKPTMGR_DEBUG=1 prints the traceback)", file=sys.stderr)
        return EXIT["internal"]
    finally:
        ctx.close()
