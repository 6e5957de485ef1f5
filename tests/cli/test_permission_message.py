"""The permission-denied message names the control group the socket really has, not the default's name."""

from __future__ import annotations

import grp
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import as_user

GROUP = "buildidd-test-ctl"


def test_denied_message_names_the_sockets_group(attacker):
    try:
        gid = grp.getgrnam(GROUP).gr_gid
    except KeyError:
        subprocess.run(["groupadd", "-r", GROUP], capture_output=True, text=True)
        gid = grp.getgrnam(GROUP).gr_gid
    d = Path(tempfile.mkdtemp(prefix="buildidd-perm-", dir="/tmp"))
    os.chmod(d, 0o755)
    path = d / "control.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        s.listen(1)
        os.chown(path, 0, gid)
        os.chmod(path, 0o660)
        r = as_user(attacker, [sys.executable, "-m", "buildidd.cli", "status", "--socket", str(path)], timeout=60)
    finally:
        s.close()
        path.unlink(missing_ok=True)
        d.rmdir()
    assert r.returncode == 4, r.stderr
    assert f"member of group '{GROUP}'" in r.stderr and "'buildidd'" not in r.stderr, r.stderr
