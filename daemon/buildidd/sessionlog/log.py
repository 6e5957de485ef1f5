"""Transitional: the session log's modules are now writer, segments, compress and reader.

Import from ``buildidd.sessionlog`` instead; this module goes once its last
importer (store.store) has moved.
"""

from buildidd.sessionlog.reader import list_segments, read_session
from buildidd.sessionlog.segments import MAX_LINE_BYTES, SEGMENT_GLOB, SegmentStats
from buildidd.sessionlog.writer import SessionWriter

__all__ = ["MAX_LINE_BYTES", "SEGMENT_GLOB", "SegmentStats", "SessionWriter", "list_segments", "read_session"]
