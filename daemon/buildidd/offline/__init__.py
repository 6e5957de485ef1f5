"""offline: sessions and their binaries away from the recording host.

Archive a session with every binary it references, import an archive into a
perf build-id cache, serve the store over the debuginfod protocol, pull from a
remote serve, replay a session to resolve addresses, export it as perf.data.

May import: capture's layers below it (store, sessionlog, resolve, kernel) and
the shared modules; never control or cli.
"""
