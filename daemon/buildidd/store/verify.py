"""What a copy in the store must be: the file its key names.

An entry's key (store.origin.KEYS) is either the GNU build-id the file carries
(its ``.note.gnu.build-id``, read back from the copy with the bounded note
reader), or, for a file without one, its htlhash (resolve.fileid.file_id:
OpenTelemetry's ``process.executable.build_id.htlhash``).  A file with a GNU
build-id is never kept under its htlhash: a GNU build-id names it.
"""

from __future__ import annotations

from buildidd.errors import ElfError
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.resolve.fileid import file_id
from buildidd.store.origin import KEY_HTLHASH


def copy_mismatch(fd: int, key_hex: str, key: str) -> str | None:
    """Why the file open on fd is not the one key_hex names (key: ``gnu`` or ``htlhash``); None when it is.

    ``gnu``: the file's GNU build-id must be key_hex.  ``htlhash``: its file_id must be
    key_hex and it must have no GNU build-id (a file that is not ELF, or malformed, has none).
    Read errors are mismatches (the copy cannot be shown to be the file).
    """
    if key == KEY_HTLHASH:
        try:
            got = file_id(fd)
            gnu = read_build_id_fd(fd)
        except ElfError:
            gnu = None
        except OSError as e:
            return f"cannot read the copy back: {e}"
        if got != key_hex:
            return f"copy has htlhash {got}, not {key_hex}"
        if gnu is not None:
            return f"has the GNU build-id {gnu.hex}: it is kept under that, not its htlhash"
        return None
    try:
        got = read_build_id_fd(fd)
    except (ElfError, OSError) as e:
        return f"copy has no readable build-id: {e}"
    if got is None or got.hex != key_hex:
        return f"copy has build-id {got.hex if got else None}, not {key_hex}"
    return None
