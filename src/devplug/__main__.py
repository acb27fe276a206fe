import sys

from devplug.cli import main

sys.exit(main())
