#!/usr/bin/env python3
"""specring's command line from a checkout: ``python launch.py [COMMAND] [FLAGS]`` (see ``specring/cli/main.py``).

Installed, the same commands are ``specring [COMMAND] [FLAGS]``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the checkout's `specring` package, installed or not

from specring.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
