"""``buildidd serve``: the build-id store over the debuginfod protocol, the sessions, /metrics.

One module per concern, each owning its routes and their handlers:
app (options, access, the application and its listeners), buildid
(``/buildid/...``, the debuginfod protocol, over debuginfod's lookups in
the store), sessions (``/sessions``, archives), metadata (``/metadata``,
from the sessions), metrics (``/metrics``),
guard (caps and deadlines against slow and flooding clients), send
(streaming a file or a section).
"""

from buildidd.offline.serve.app import DEFAULT_LISTEN, ServeOptions, make_app, parse_listen, read_token, run

__all__ = ["DEFAULT_LISTEN", "ServeOptions", "make_app", "parse_listen", "read_token", "run"]
