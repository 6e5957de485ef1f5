"""fsio: every byte written through short writes, and a replaced file whole or not at all (a full tmpfs)."""

from __future__ import annotations

import os
import subprocess

import pytest

from buildidd import fsio
from buildidd.fsio import fsync_dir, replace_file, write_all


def test_write_all_writes_every_byte_through_short_writes(tmp_path, monkeypatch):
    """A write(2) may take fewer bytes than asked (a signal, a pipe, a socket): each here takes at most
    4 KiB, and one that takes none is an error, not a loop."""
    real_write = os.write
    calls = []

    def short_write(fd, data):
        calls.append(len(data))
        return real_write(fd, bytes(data[:4096]))

    data = os.urandom(100_000)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        monkeypatch.setattr(fsio.os, "write", short_write)
        write_all(fd, data)
        monkeypatch.setattr(fsio.os, "write", lambda fd, data: 0)
        with pytest.raises(OSError):
            write_all(fd, b"x")
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data
    assert len(calls) == -(-len(data) // 4096)            # one call per 4 KiB, none after the last byte


def test_replace_file_by_path_and_by_directory_fd(tmp_path):
    (tmp_path / "f").write_bytes(b"old")
    replace_file(tmp_path, "f", b"new", 0o640)
    assert (tmp_path / "f").read_bytes() == b"new"
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640 & ~_umask()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        replace_file(fd, "f", b"newer", 0o600)
        fsync_dir(fd)
    finally:
        os.close(fd)
    fsync_dir(tmp_path)
    assert (tmp_path / "f").read_bytes() == b"newer"
    assert sorted(os.listdir(tmp_path)) == ["f"]
    with pytest.raises(ValueError):
        replace_file(tmp_path, "../f", b"x", 0o600)


def test_a_full_disk_leaves_the_old_file_and_no_temporary_file(tmp_path):
    """ENOSPC on a 1 MiB tmpfs: the old content stays, the temporary file is gone."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "f").write_bytes(b"old")
        with pytest.raises(OSError) as e:
            replace_file(mnt, "f", os.urandom(2 << 20), 0o600)
        assert e.value.errno == 28                          # ENOSPC
        assert (mnt / "f").read_bytes() == b"old"
        assert sorted(os.listdir(mnt)) == ["f"], os.listdir(mnt)       # no temporary file left
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
