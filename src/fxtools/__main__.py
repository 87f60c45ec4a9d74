"""``python -m fxtools``: the ``fxtools`` command."""

import sys

from .cli.main import main

sys.exit(main())
