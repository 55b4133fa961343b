"""``python -m relaxspec.cli``: the same as the ``relaxspec`` command."""

import sys

from relaxspec.cli import main

sys.exit(main())
