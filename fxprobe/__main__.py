"""``python -m fxprobe``: the ``fxprobe`` command, ``demo`` unless a command is named.

``python -m fxprobe`` is ``fxprobe demo`` and ``python -m fxprobe -o demo.png`` is
``fxprobe demo -o demo.png``; ``python -m fxprobe sites MODEL`` is ``fxprobe sites MODEL``.
"""

import sys

from .cli import main


def _argv(args: list[str]) -> list[str]:
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help", "--version")):
        return ["demo", *args]
    return args


if __name__ == "__main__":
    sys.exit(main(_argv(sys.argv[1:])))
