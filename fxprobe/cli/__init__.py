"""The ``fxprobe`` command: list a model's sites, draw its graph, run the demo or benchmarks.

Every mistake in what the user typed (a bad ``MODEL`` spec, a missing file or factory, a
factory that does not return a module, a bad ``--input`` or ``--ops``) is reported as one line
on stderr with exit status 2, never a traceback.

:mod:`.app` builds the parser and runs a command, :mod:`.commands` holds the commands, and
:mod:`.arguments` turns ``MODEL``, ``--input`` and ``--ops`` into a model, tensors and
selectors.
"""

from .app import main

__all__ = ["main"]
