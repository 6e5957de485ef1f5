"""``python -m buildidd.cli``: the same as the ``buildidd`` command."""

import sys

from buildidd.cli.main import main

sys.exit(main())
