"""The recording daemon's store against a real unprivileged user: a forged build-id mapped first loses."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from buildidd.store import Store

from conftest import as_user, gcc, readelf_build_id

FORGED_BID = "bad5eed0" * 5


def test_forged_build_id_run_first_by_a_user_never_becomes_the_store_copy(recorder, attacker):
    public = Path(tempfile.mkdtemp(prefix="buildidd-hostile-"))
    system = Path(tempfile.mkdtemp(prefix="buildidd-test-", dir="/usr/lib"))
    try:
        os.chmod(public, 0o755)
        os.chmod(system, 0o755)
        forged = gcc("int main(void) { return 66; }", public / "tac", f"-Wl,--build-id=0x{FORGED_BID}")
        real = gcc("int main(void) { return 0; }", system / "tac", f"-Wl,--build-id=0x{FORGED_BID}")
        os.chown(forged, attacker[0], attacker[1])
        os.chmod(forged, 0o755)
        os.chmod(real, 0o755)
        assert readelf_build_id(forged) == readelf_build_id(real) == FORGED_BID
        store_root = public / "store"
        rec = recorder(store_root=str(store_root), snapshot_rate_bytes_per_s=0)
        store = Store(store_root)

        def settle(until):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not until():
                rec.step()
                time.sleep(0.05)

        assert as_user(attacker, [str(forged)]).returncode == 66      # mapped before the real one ever ran
        settle(lambda: store.contains(FORGED_BID))
        assert store.origin(FORGED_BID) is not None, sorted(str(p) for p in store_root.rglob("*"))
        assert store.origin(FORGED_BID).uid == attacker[0] and not store.origin(FORGED_BID).trusted
        assert subprocess.run([str(real)]).returncode == 0
        settle(lambda: store.origin(FORGED_BID).trusted)
        assert store.best(FORGED_BID).read_bytes() == real.read_bytes(), (rec.snapshotter.status(), store.origin(FORGED_BID))
        assert store.origin(FORGED_BID).uid == 0 and store.origin(FORGED_BID).path == str(real)
        alt = store.path_of(FORGED_BID).parent / "alt"
        assert [(d / "elf").read_bytes() for d in alt.iterdir()] == [forged.read_bytes()]   # kept, not served
        status = rec.snapshotter.status()
        assert status["conflicts"] == 1 and status["promoted"] == 1
        # Not readable by the attacker: 0750 root:group directories, 0640 files.
        assert as_user(attacker, ["cat", str(store.best(FORGED_BID))]).returncode != 0
    finally:
        # The recorder (closed by its fixture after this) may still be adding entries under public/store.
        shutil.rmtree(public, ignore_errors=True)
        shutil.rmtree(system)
