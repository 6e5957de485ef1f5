"""sessionlog: the session log, one JSON record per line, in rotating segments.

Record templates and their JSON form (records), the writer with rotation and
fsync policy and the compression of closed segments (log), the reader that
tolerates torn lines and old formats, and retention of old sessions.

May import: resolve, kernel, and the shared modules; never store.
"""
