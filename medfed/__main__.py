"""``python -m medfed ...`` — see :mod:`medfed.cli`."""

import sys

from medfed.cli import main

sys.exit(main())
