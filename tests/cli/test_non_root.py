"""Offline verbs run by an analyst who is not root: sessions go to and are found in their XDG data home,
and a directory they cannot write is named with the option to pass (a real unprivileged user)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import as_user
from tests.cli.test_times_addresses import _live_session

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]


def _archive(public_tmp_factory):
    """A session written by root, archived by root into a directory every user can read: (archive, name)."""
    pub = public_tmp_factory()
    session = pub / "20261126T000000-test"
    _live_session(session)
    out = pub / "a.tar.zst"
    r = subprocess.run([*BUILDIDD, "archive", str(session), "-o", str(out), "--store-root", ""],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    os.chmod(out, 0o644)
    return out, session.name


def _home(public_tmp_factory, attacker):
    home = public_tmp_factory("buildidd-home-")
    os.chown(home, attacker[0], attacker[1])
    os.chmod(home, 0o700)
    return home


def _as(attacker, home, *args, **env):
    return as_user(attacker, [sys.executable, "-m", "buildidd.cli", *args], timeout=120,
                   env={"PATH": "/usr/bin:/bin", "HOME": str(home), **env})


def test_import_show_resolve_and_sessions_use_the_users_data_home(attacker, public_tmp_factory):
    archive, name = _archive(public_tmp_factory)
    home = _home(public_tmp_factory, attacker)
    mine = home / ".local/share/buildidd/sessions"
    r = _as(attacker, home, "import", str(archive))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"session {name} -> {mine / name}"
    assert (mine / name).is_dir() and (home / ".debug").is_dir()
    r = _as(attacker, home, "sessions")
    assert r.returncode == 0 and r.stdout.splitlines()[1].split()[0] == name, r.stdout + r.stderr
    r = _as(attacker, home, "show", "latest", "--type", "exec", "--json")
    assert r.returncode == 0 and '"filename":"/bin/b"' in r.stdout, r.stderr
    r = _as(attacker, home, "resolve", name, "100", "1800", "--store-root", "")
    assert r.returncode == 0 and r.stdout.split()[2] == "/bin/b", r.stdout + r.stderr
    # XDG_DATA_HOME, when set, is where they go.
    r = _as(attacker, home, "import", str(archive), XDG_DATA_HOME=str(home / "xdg"))
    assert r.returncode == 0 and (home / "xdg/buildidd/sessions" / name).is_dir(), r.stderr


def test_no_session_yet_says_whose_root_it_looked_in(attacker, public_tmp_factory):
    home = _home(public_tmp_factory, attacker)
    r = _as(attacker, home, "show", "latest")
    mine = home / ".local/share/buildidd/sessions"
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith(f"buildidd: no session under {mine}")
    assert (f"; {mine} is yours as you are not root (buildidd import puts sessions there)" in r.stderr
            and r.stderr.endswith("; give a session directory or --session-root DIR\n"))


def test_a_session_root_the_user_cannot_write_names_the_option(attacker, public_tmp_factory):
    archive, _ = _archive(public_tmp_factory)
    home = _home(public_tmp_factory, attacker)
    closed = public_tmp_factory("buildidd-rootonly-")
    os.chmod(closed, 0o700)                          # root's
    r = _as(attacker, home, "import", str(archive), "--session-root", str(closed / "sessions"))
    assert r.returncode == 4 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"buildidd: import: cannot write {closed}/sessions")
    assert r.stderr.endswith(": Permission denied; run as root, or give --session-root DIR (a directory of yours)\n")
