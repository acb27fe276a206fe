"""``python -m devplug.testing``: see :mod:`devplug.testing.console`."""

import sys

from devplug.testing.console import main

sys.exit(main())
