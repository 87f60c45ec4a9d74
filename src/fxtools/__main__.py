"""``python -m fxtools``: the ``fxtools`` command."""
import sys

from .cli import main

sys.exit(main())
