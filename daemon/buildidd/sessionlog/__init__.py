"""sessionlog: the session log, one JSON record per line, in rotating segments.

Record templates and their JSON form (records), the writer with rotation and
fsync policy (writer), the segment files and their layout (segments), the
compression of closed segments (compress), the write engine that resumes
after ENOSPC/EIO (append, backlog), sealing of sessions a crash left open
(seal), the reader that tolerates torn
lines and old formats (reader), the gap file written at a session's end
(gapfile), and retention of old sessions.

May import: resolve, kernel, and the shared modules; never store.

The names below are the session log's public API (other stages import them
from ``buildidd.sessionlog``, never from its modules).
"""

from buildidd.sessionlog.gapfile import find_gap_file, read_gaps, write_gaps
from buildidd.sessionlog.reader import list_segments, read_session
from buildidd.sessionlog.retention import enforce_retention, session_build_ids, sessions_usage
from buildidd.sessionlog.seal import SealReport, seal_unclosed_sessions
from buildidd.sessionlog.segments import SEGMENT_GLOB
from buildidd.sessionlog.writer import SessionWriter

__all__ = ["SEGMENT_GLOB", "SealReport", "SessionWriter", "enforce_retention", "find_gap_file", "list_segments",
           "read_gaps", "read_session", "seal_unclosed_sessions", "session_build_ids", "sessions_usage", "write_gaps"]
