"""The control socket: a local, authenticated JSON-lines command channel.

::

    ControlClient ──"{"cmd":...}\\n"──▶ ControlServer (own thread, selectors)
       (CLI, tests) ◀─"{"ok":...}\\n"───   │  SO_PEERCRED check, size cap, timeouts
                                          ▼
                                     handlers[cmd](args) → JSON result

``protocol`` is the wire format (JSON only, never pickle), ``server`` serves
handlers (socket file, peer checks, accept loop; ``connection`` reads,
answers and times out each connection), ``client`` is the one client.

May import: every stage below cli (capture, store, sessionlog, resolve, kernel)
and the shared modules.
"""

from buildidd.control.client import ControlClient
from buildidd.control.protocol import ControlError, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES
from buildidd.control.server import ControlServer, Peer, ServerOptions

__all__ = ["ControlClient", "ControlError", "ControlServer", "MAX_REQUEST_BYTES", "MAX_RESPONSE_BYTES", "Peer",
           "ServerOptions"]
