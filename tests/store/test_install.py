"""Installer.atomic_file, the one path by which a file enters the store, and its one clean-up."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from buildidd.errors import StoreError
from buildidd.store.counters import Tally
from buildidd.store.install import Installed, Installer
from buildidd.store.layout import FILE_MODE, TEMP_INFIX, Layout


@pytest.fixture
def installer(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    return Installer(Layout(root), Tally())


def _temps(directory) -> list[str]:
    return [n for n in os.listdir(directory) if TEMP_INFIX in n]


def test_a_file_appears_whole_with_the_store_mode(installer):
    final = installer.layout.root / "f"
    done = Installed()
    with installer.atomic_file(final, FILE_MODE, done) as fd:
        assert not final.exists() and len(_temps(final.parent)) == 1   # written under its temporary name
        os.write(fd, b"payload")
    assert final.read_bytes() == b"payload" and done.files == [final]
    assert stat.S_IMODE(final.stat().st_mode) == FILE_MODE and _temps(final.parent) == []


def test_a_body_that_refuses_leaves_nothing_and_is_not_a_copy_error(installer):
    final = installer.layout.root / "refused"
    done = Installed()
    with pytest.raises(StoreError, match="not this one"):
        with installer.atomic_file(final, FILE_MODE, done) as fd:
            os.write(fd, b"half")
            raise StoreError("not this one")
    assert not final.exists() and _temps(final.parent) == [] and done.files == []
    assert installer.tally.counters["copy_errors"] == 0


def test_an_os_error_in_the_body_is_named_counted_and_cleaned_up(installer):
    final = installer.layout.root / "eio"
    with pytest.raises(StoreError, match=r"/src: cannot write into the store: Input/output error"):
        with installer.atomic_file(final, FILE_MODE, Installed(), what="/src"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    assert not final.exists() and _temps(final.parent) == []
    assert installer.tally.counters["copy_errors"] == 1


def test_a_rename_that_fails_leaves_the_final_name_as_it_was(installer):
    final = installer.layout.root / "taken"
    final.mkdir()
    (final / "inside").write_bytes(b"kept")          # rename(2) of a file over a directory: EISDIR
    with pytest.raises(StoreError, match="cannot rename into place"):
        with installer.atomic_file(final, FILE_MODE, Installed()) as fd:
            os.write(fd, b"new")
    assert (final / "inside").read_bytes() == b"kept" and _temps(final.parent) == []
    assert installer.tally.counters["copy_errors"] == 1


def test_install_bytes_and_stream_take_the_same_path(installer, tmp_path):
    src = tmp_path / "source"
    src.write_bytes(b"x" * 100)
    done = Installed()
    assert installer.install_bytes(installer.layout.root / "b", b"abc", FILE_MODE, done) == 3
    assert installer.install_stream(src, installer.layout.root / "s", FILE_MODE, done) == 100

    def refuse(first: bytes) -> None:
        raise StoreError(f"refused {len(first)} bytes")

    with pytest.raises(StoreError, match="refused 100 bytes"):
        installer.install_stream(src, installer.layout.root / "r", FILE_MODE, done, check=refuse)
    assert [p.name for p in done.files] == ["b", "s"] and _temps(installer.layout.root) == []
    assert not (installer.layout.root / "r").exists()
