"""``python -m fxprobe``: the ``fxprobe`` command; with no arguments, ``fxprobe demo``."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["demo"]))
