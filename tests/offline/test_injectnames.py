"""injectnames: the name each version of a path gets in an injected profile (PATH@BIDPREFIX), its collisions
and limits.  Real perf reads these names in tests/integration/test_inject.py."""

from __future__ import annotations

from buildidd.offline.injectnames import MIN_TAG_HEX, VersionNames
from buildidd.offline.perfdata import MAX_NAME_BYTES

V1, V2, V3 = "1a2b3c4d" + "00" * 16, "9f8e7d6c" + "11" * 16, "55" * 20


def _names(*records: tuple[bytes, str | None]) -> VersionNames:
    n = VersionNames()
    for name, bid in records:
        n.see(name, bid)
    n.assign()
    return n


def test_one_build_id_keeps_the_path_and_several_are_each_named():
    n = _names((b"/usr/bin/app", V1), (b"/usr/bin/app", V1), (b"/usr/lib/libx.so", V1),
               (b"/usr/lib/libx.so", V2), (b"/usr/lib/libx.so", V3), (b"/usr/lib/libx.so", None))
    assert n.name(b"/usr/bin/app", V1) == b"/usr/bin/app"
    assert [n.name(b"/usr/lib/libx.so", b) for b in (V1, V2, V3)] == \
        [b"/usr/lib/libx.so@1a2b3c4d", b"/usr/lib/libx.so@9f8e7d6c", b"/usr/lib/libx.so@55555555"]
    assert n.paths_renamed == 1 and n.too_long == 0 and len(n.names) == 3


def test_the_prefix_grows_until_the_versions_differ():
    a, b = "abcdef0123" + "00" * 15, "abcdef0124" + "00" * 15
    n = _names((b"/p", a), (b"/p", b), (b"/p", V1))
    # 10 characters tell a from b; every version of /p gets 10.
    assert {n.name(b"/p", x) for x in (a, b, V1)} == {b"/p@abcdef0123", b"/p@abcdef0124", b"/p@1a2b3c4d00"}


def test_a_build_id_that_is_a_prefix_of_another_still_gets_a_name_of_its_own():
    short, long_ = "abcdef01" * 2, "abcdef01" * 2 + "77" * 12          # 8 and 20 bytes, one the other's start
    n = _names((b"/p", short), (b"/p", long_))
    assert n.name(b"/p", short) != n.name(b"/p", long_)
    assert n.name(b"/p", short) == b"/p@" + short.encode()


def test_a_name_someone_gave_a_file_on_the_host_is_never_reused():
    """A file on the host named like a version (x@1a2b3c4d): the version's prefix is lengthened; with every
    prefix taken, a counter is appended."""
    n = _names((b"/t/x", V1), (b"/t/x", V2), (b"/t/x@1a2b3c4d", "ee" * 20))
    assert n.name(b"/t/x", V1) == b"/t/x@1a2b3c4d0"
    assert n.name(b"/t/x@1a2b3c4d", "ee" * 20) == b"/t/x@1a2b3c4d"       # the host's own file keeps its name
    taken = [(b"/t/y@" + V1[:k].encode(), None) for k in range(MIN_TAG_HEX, len(V1) + 1)]
    n = _names((b"/t/y", V1), (b"/t/y", V2), *taken, (b"/t/y@" + V1.encode() + b"~2 (deleted)", None))
    assert n.name(b"/t/y", V1) == b"/t/y@" + V1.encode() + b"~3"
    assert len({n.name(b"/t/y", V1), n.name(b"/t/y", V2)} | {t for t, _ in taken}) == len(taken) + 2


def test_a_deleted_file_counts_as_its_path_and_keeps_the_suffix():
    n = _names((b"/opt/app (deleted)", V1), (b"/opt/app", V2))
    assert n.name(b"/opt/app (deleted)", V1) == b"/opt/app@1a2b3c4d (deleted)"
    assert n.name(b"/opt/app", V2) == b"/opt/app@9f8e7d6c"


def test_a_name_too_long_for_perf_keeps_the_path_and_is_counted():
    long_path = b"/" + b"d" * (MAX_NAME_BYTES - 5)
    n = _names((long_path, V1), (long_path, V2))
    assert n.name(long_path, V1) == long_path and n.too_long == 2 and n.paths_renamed == 1
    fits = b"/" + b"e" * (MAX_NAME_BYTES - 30)
    n = _names((fits + b" (deleted)", V1), (fits, V2))
    assert n.too_long == 0
    assert n.name(fits + b" (deleted)", V1) == fits + b"@1a2b3c4d (deleted)"
    assert len(n.name(fits + b" (deleted)", V1)) <= MAX_NAME_BYTES


def test_names_do_not_depend_on_record_order():
    recs = [(b"/a", V1), (b"/a", V2), (b"/b", V2), (b"/b", V3), (b"/a@9f8e7d6c", V3)]
    one, two = _names(*recs), _names(*reversed(recs))
    assert one.names == two.names
