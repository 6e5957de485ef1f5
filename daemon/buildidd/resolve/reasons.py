"""Why a mapping has no build-id: one enum, written to the session log as its value.

The values are the strings of the session log's ``error`` field (README,
"error values") and of :attr:`buildidd.errors.ElfError.reason`; a
:class:`MissReason` is a ``str``, so it compares equal to, hashes like and
JSON-encodes as its value.
"""

from __future__ import annotations

import enum

__all__ = ["MissReason"]


class MissReason(enum.StrEnum):
    """Why no build-id was recorded for a mapping (the log's ``error`` field)."""

    #: An ELF file that is sound and has no GNU build-id note.
    NO_BUILD_ID = "no_build_id"
    #: The file does not start with the ELF magic (ELF gABI ``e_ident``); an empty file.
    NOT_ELF = "not_elf"
    #: ELF headers, a table, segment or note out of bounds or inconsistent, or a
    #: build-id note of 0 or more than 64 bytes.
    MALFORMED_ELF = "malformed_elf"
    #: An ELF class or byte order the reader does not handle, or a cap reached
    #: (headers, notes or bytes read) before a build-id was found.
    UNSUPPORTED_ELF = "unsupported_elf"
    #: The process is gone and the mapping's path names another file now.
    FILE_REPLACED = "file_replaced"
    #: The mapped file was deleted (no link left, or a memfd).
    FILE_DELETED = "file_deleted"
    #: No way to reach the mapped file was left (process and path gone).
    FILE_VANISHED = "file_vanished"
    #: Opening the file (map_files, proc root or path) was refused (EACCES, EPERM).
    PERMISSION = "permission"
    #: Reading the file failed (EIO, ...).
    IO_ERROR = "io_error"
    #: Resolution did not finish within Config.resolve_deadline_s (a slow or
    #: hostile file system, a stuck worker, or the worker queue full); a later
    #: ``resolution`` record may complete it.
    TIMEOUT = "timeout"
    #: The file lies on a FUSE file system (statfs f_type FUSE_SUPER_MAGIC): its
    #: contents are served by a process, possibly the mapping user's; not read.
    SLOW_FS = "slow_fs"
    #: The path or link reached something other than a regular file (a FIFO, a
    #: device, a directory, a symlink at the last component): never opened for reading.
    NOT_REGULAR = "not_regular"
    #: The kernel could not read the build-id at the mapping (kernel_status), and
    #: the file's ctime lies within one coarse clock tick before the mapping: a
    #: rewrite in place in that tick leaves no trace in its identity, so the
    #: bytes read now may not be the bytes mapped (resolve.procfs.changed_near).
    CHANGED_AT_MAP = "changed_at_map"
