"""The push service's status file, ``STATE_DIR/status.json``: written by the push, read by
``buildidd status`` and ``buildidd push --status``.

A module of its own, importing no S3 client: reading the status must not cost
``buildidd status`` the import of boto3 (the push's client, fleet.bucket).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from buildidd.errors import PushError

__all__ = ["STATUS_NAME", "read_status", "write_status"]

#: The file's name under push_state_dir.
STATUS_NAME = "status.json"


def write_status(state_dir: str | os.PathLike, status: dict) -> None:
    """Write status (JSON-ready) to ``STATE_DIR/status.json``: a temporary file, then a rename, so a reader
    sees the old status or the new one, whole.

    Raises:
        OSError: the directory is not writable (full, gone).
    """
    path = Path(state_dir) / STATUS_NAME
    tmp = path.with_name(f".{STATUS_NAME}.tmp")
    with open(tmp, "w") as f:
        json.dump(status, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_status(state_dir: str | os.PathLike) -> dict:
    """The last status a push wrote under state_dir.

    Raises:
        PushError: ``config``: none there (push never ran with this state directory), or unreadable.
    """
    path = Path(state_dir) / STATUS_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise PushError("config", f"{path}: no status: push has not run with push_state_dir = {state_dir}") from e
    except (OSError, ValueError) as e:
        raise PushError("config", f"{path}: {e}") from e
