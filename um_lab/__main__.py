"""``python -m um_lab``: the ``um-lab`` command line."""

import sys

from um_lab.app.cli import main

sys.exit(main())
