"""The `folio` command's entry point: parse, dispatch, and turn any failure into one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from folio.cli import commands
from folio.cli.parser import parse

HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "pull": commands.cmd_pull,
    "models": commands.cmd_models,
    "run": commands.cmd_run,
    "chat": commands.cmd_chat,
    "generate": commands.cmd_generate,
    "run-batch": commands.cmd_run_batch,
    "serve": commands.cmd_serve,
    "worker": commands.cmd_worker,
}


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    # folio's own progress at INFO; other libraries (httpx logs every request at INFO) only warn.
    logging.basicConfig(level=logging.WARNING, format="folio: %(message)s", stream=sys.stderr)
    logging.getLogger("folio").setLevel(logging.INFO)
    try:
        return HANDLERS[args.command](args) if args.command in HANDLERS else args.tool_run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # one line for the user; FOLIO_DEBUG=1 shows the traceback
        if os.environ.get("FOLIO_DEBUG"):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"folio: error: {message}", file=sys.stderr)
        return 1
