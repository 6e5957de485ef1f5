"""cli: the ``buildidd`` command, one module per verb family.

``buildidd.cli:main`` is the entry point (pyproject.toml).  May import every
stage; nothing imports cli.
"""

from buildidd.cli.main import main

__all__ = ["main"]
