"""`python -m folio.cli`: the `folio` command."""

import sys

from folio.cli.main import main

sys.exit(main())
