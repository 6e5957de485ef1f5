"""fsio: every byte written through short writes, and a replaced file whole or not at all (a full tmpfs)."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from buildidd.fsio import fsync_dir, replace_file, temp_name_for, write_all


def test_write_all_writes_every_byte_through_short_writes():
    """A pipe takes at most its buffer per write while the reader drains it: many short writes."""
    r, w = os.pipe()
    data = os.urandom(1 << 20)        # 16 times a pipe's default 64 KiB
    got = bytearray()

    def drain():
        while chunk := os.read(r, 1 << 14):
            got.extend(chunk)

    t = threading.Thread(target=drain)
    t.start()
    try:
        write_all(w, data)
    finally:
        os.close(w)
        t.join(10)
        os.close(r)
    assert bytes(got) == data


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
        assert sorted(os.listdir(mnt)) == ["f"], os.listdir(mnt)
        assert not (mnt / temp_name_for("f")).exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
