"""`folio` command line: pull, models, run, chat, serve, generate, run-batch, kv-calc, quantize, eval, bench.

The top layer: parser.py builds the parser (engine flags from `EngineArgs`), main.py dispatches to
commands.py.
kv-calc, quantize, eval and bench are folio's tools (tools/, the folio-tools package): they register
themselves through the `folio.tools` entry point, so this package never imports them, and where they are
not installed those commands say how to install them. Nothing imports this package.

Every failure a user can cause ends in one line on stderr and a non-zero exit; set FOLIO_DEBUG=1 to
see the traceback instead.
"""

from folio.cli.main import main
from folio.cli.parser import build_parser, parse

__all__ = ["build_parser", "main", "parse"]
