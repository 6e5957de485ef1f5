"""``buildidd serve`` does not tell a local user whether a private binary ran on the host (issue 42, item 6).

Before: any local user over loopback got 403 "held, but private" for a private build-id and 404 for an
unknown one, and read /metrics without a token.  Now a caller without rights gets, for a private
build-id, byte for byte the answer of one the store does not hold, on every route that looks one up,
and serve decides it without opening the private file; the reason goes to callers with rights (the
token, root or the control group on the unix socket), and so does /metrics unless
``serve_metrics_public`` opens it.

Real parts: a gcc binary and a Go binary (no GNU build-id: keyed by its htlhash, and found by its Go
build ID) built in a 0700 directory, so the store marks them private; ``buildidd serve`` as a
subprocess; the attacker (a real unprivileged user, the ``attacker`` fixture) asking over loopback TCP
and over the unix socket with tests/offline/hostile_client.py, and with the real ``debuginfod-find``;
inotify watching the private entries' directories for any open of their files.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import struct
import subprocess
from pathlib import Path

import pytest

from buildidd.resolve.fileid import file_id, read_go_build_id
from buildidd.sessionlog import SessionWriter
from buildidd.store import Store
from conftest import ServeProcess, as_user, gcc, store_add
from offline.promtext import samples, value
from offline.test_serve import request, request_unix

CLIENT = str(Path(__file__).with_name("hostile_client.py"))
SYSTEM_PYTHON = "/usr/bin/python3"
TOKEN = "private-existence-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SESSION = "20261127T000000Z-42"
SRC = '#include <stdio.h>\nint secret_fn(void) { return 42; }\nint main(void) { return secret_fn() != 42; }\n'
UNKNOWN_BID = "5e" * 20            # a build-id of the same length, not held
UNKNOWN_KEY = "a7" * 16            # an htlhash, not held
IN_OPEN = 0x20                     # include/uapi/linux/inotify.h
IN_ISDIR = 0x40000000
_EVENT = struct.Struct("iIII")     # struct inotify_event: wd, mask, cookie, len; then name[len]


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory, attacker):
    """A store whose ``secret`` (gcc, -g) and ``gosecret`` (Go, keyed by htlhash) came from a 0700 directory,
    and a public binary; a session naming the secret; a token; a public directory for the unix socket."""
    from store.test_htlhash import go_build
    tmp = tmp_path_factory.mktemp("serve-private")
    home = tmp / "home"
    home.mkdir(mode=0o700)
    secret = gcc(SRC, home / "secret", "-g")
    gosecret = go_build(home, "gosecret")
    public = gcc(SRC.replace("42", "7"), public_tmp_factory("buildidd-private-pub-") / "public")
    store = Store(tmp / "store", debug_root=tmp / "no-debug")
    bid = store_add(store, secret)
    fd = os.open(gosecret, os.O_RDONLY)
    try:
        go_id, key = read_go_build_id(fd), file_id(fd)
        store.add_from_fd(fd, str(gosecret), key, key="htlhash")
    finally:
        os.close(fd)
    assert store.is_private(bid) and store.is_private(key), "the fixture's binaries must be private"
    pub = store_add(store, public)
    assert not store.is_private(pub)
    w = SessionWriter(tmp / "sessions" / SESSION, compress=False)
    w.write({"type": "session", "time_ns": 1, "host": "h", "boot_id": "b", "boot_to_wall_offset_ns": 0})
    w.write({"type": "mmap", "time_ns": 2, "pid": 5, "tid": 5, "comm": "secret", "start": 0x400000, "len": 4096,
             "pgoff": 0, "path": str(secret), "build_id": bid, "error": None})
    w.write({"type": "end", "time_ns": 3})
    w.close()
    (tmp / "token").write_text(TOKEN + "\n")
    (tmp / "share.toml").write_text("store_share_private = true\n")
    (tmp / "public-metrics.toml").write_text("serve_metrics_public = true\n")
    unknown_go = go_id[:-1] + ("A" if go_id[-1] != "A" else "B")
    return {"tmp": tmp, "store": store, "bid": bid, "key": key, "go_id": go_id, "unknown_go": unknown_go,
            "public": pub, "secret": secret, "gosecret": gosecret, "sock_dir": public_tmp_factory("buildidd-pv-sock-"),
            "entry_dirs": [store.path_of(bid).parent, store.path_of(key).parent]}


def _serve(world, name: str, *extra: str, sock: bool = False) -> ServeProcess:
    args = list(extra) + (["--unix-socket", str(world["sock_dir"] / f"{name}.sock")] if sock else [])
    return ServeProcess(world["tmp"] / "store", world["tmp"] / f"{name}.log", *args,
                        session_root=world["tmp"] / "sessions")


def _pairs(world) -> list[tuple[str, str, str]]:
    """(method, private path, unknown path) for every route that looks a build-id up."""
    bid, key = world["bid"], world["key"]
    out = []
    for held, absent in ((bid, UNKNOWN_BID), (key, UNKNOWN_KEY)):
        for tail in ("executable", "debuginfo", "section/.text", "section/.debug_info", "section/.nosuch",
                     "source/usr/src/secret.c"):
            out += [(m, f"/buildid/{held}/{tail}", f"/buildid/{absent}/{tail}") for m in ("GET", "HEAD")]
    out += [(m, f"/go-buildid/{world['go_id']}/executable", f"/go-buildid/{world['unknown_go']}/executable")
            for m in ("GET", "HEAD")]
    out.append(("GET", f"/metadata?key=file&value={world['secret']}", "/metadata?key=file&value=/nowhere/secret"))
    return out


def _fetch(attacker, target: str, method: str, paths: list[str]) -> list[dict]:
    """The attacker's answers to paths, asked in turn on one connection to target (HOST:PORT or a socket)."""
    r = as_user(attacker, [SYSTEM_PYTHON, CLIENT, "fetch", target, method, *paths], timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["answers"]


def _seen(answer: dict) -> tuple:
    """What a client sees of an answer: status, headers (all but Date, in order), body."""
    return answer["status"], [tuple(h) for h in answer["headers"] if h[0].lower() != "date"], answer["body"]


class _Opens:
    """inotify IN_OPEN on directories: the names of the files opened in them (not the directories)."""

    def __init__(self, dirs: list[Path]):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        for d in dirs:
            assert self.libc.inotify_add_watch(self.fd, os.fsencode(d), IN_OPEN) >= 0, os.strerror(ctypes.get_errno())

    def names(self) -> list[str]:
        out = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            pos = 0
            while pos < len(data):
                _wd, mask, _cookie, length = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size:pos + _EVENT.size + length].rstrip(b"\0").decode()
                if not mask & IN_ISDIR:
                    out.append(name)
                pos += _EVENT.size + length

    def close(self) -> None:
        os.close(self.fd)


def _assert_alike(answers: list[dict], pairs: list[tuple[str, str, str]]) -> None:
    for i, (method, held, absent) in enumerate(pairs):
        a, b = answers[2 * i], answers[2 * i + 1]
        assert _seen(a) == _seen(b), (method, held, absent, a, b)
        assert not any(h[0].lower().startswith("x-buildidd") for h in a["headers"]), (held, a)
        assert a["status"] == (403 if held.startswith("/metadata") else 404), (held, a)


def _ask_all(attacker, target: str, pairs) -> list[dict]:
    """Each pair's private path then its unknown one, as the attacker, method by method (order kept)."""
    answers: list[dict] = []
    for method, held, absent in pairs:
        answers += _fetch(attacker, target, method, [held, absent])
    return answers


def test_without_rights_a_private_build_id_is_answered_as_an_unknown_one_unopened(world, attacker):
    """Loopback TCP and the unix socket, a user outside the control group: every route, GET and HEAD, the same
    status, headers (no X-Buildidd-*) and body for the private key as for an absent one; meanwhile no file of the
    private entries is opened (and one is, as soon as a token holder is served it: the watch works)."""
    serve = _serve(world, "norights", sock=True)
    opens = _Opens(world["entry_dirs"])
    pairs = _pairs(world)
    try:
        _assert_alike(_ask_all(attacker, f"127.0.0.1:{serve.port}", pairs), pairs)
        _assert_alike(_ask_all(attacker, str(world["sock_dir"] / "norights.sock"), pairs), pairs)
        opened = [n for n in opens.names() if n != "origin.json"]
        assert opened == [], opened
        status, _, text = request_unix(world["sock_dir"] / "norights.sock", "GET", "/metrics")   # root: rights
        assert status == 200 and b'result="withheld"' not in text, text    # counted as misses, like unknown ones
        assert b'buildidd_serve_lookups_total{artifact="executable",result="miss"}' in text
    finally:
        serve.stop()
    shared = _serve(world, "shared-token", "--token-file", str(world["tmp"] / "token"),
                    "--config", str(world["tmp"] / "share.toml"))
    try:
        status, _, body = request(shared.url, "GET", f"/buildid/{world['bid']}/executable", AUTH)
        assert status == 200 and body == world["secret"].read_bytes()
        assert "elf" in opens.names()
    finally:
        shared.stop()
        opens.close()


def test_callers_with_rights_are_told_it_is_held_but_private(world, attacker):
    """Root on the unix socket and a token holder get 403 with the reason and X-Buildidd-Withheld on every
    artifact route, 404 for the unknown one; shared (store_share_private), only they get the file."""
    serve = _serve(world, "rights", sock=True)
    tok = _serve(world, "rights-token", "--token-file", str(world["tmp"] / "token"))
    sock = world["sock_dir"] / "rights.sock"
    try:
        for method, held, absent in _pairs(world):
            if "/source/" in held or held.startswith("/metadata"):
                continue
            for ask in (lambda p: request_unix(sock, method, p), lambda p: request(tok.url, method, p, AUTH)):
                status, headers, body = ask(held)
                assert status == 403 and headers.get("x-buildidd-withheld") == "private", (held, status)
                assert method == "HEAD" or b"store_share_private" in body, body
                assert ask(absent)[0] == 404, absent
        _, _, text = request(tok.url, "GET", "/metrics", AUTH)
        assert b'buildidd_serve_lookups_total{artifact="executable",result="withheld"}' in text
    finally:
        serve.stop()
        tok.stop()
    shared = _serve(world, "rights-shared", "--config", str(world["tmp"] / "share.toml"), sock=True)
    try:
        path = f"/go-buildid/{world['go_id']}/executable"
        status, _, body = request_unix(world["sock_dir"] / "rights-shared.sock", "GET", path)
        assert status == 200 and body == world["gosecret"].read_bytes()
        private, unknown = _fetch(attacker, f"127.0.0.1:{shared.port}", "GET",
                                  [path, f"/go-buildid/{world['unknown_go']}/executable"])
        assert _seen(private) == _seen(unknown) and private["status"] == 404
    finally:
        shared.stop()


def test_answer_time_does_not_tell_private_from_unknown(world, attacker):
    """The decision is taken from origin.json before the file is opened: the attacker's median answer times
    for the private build-id and an absent one differ by less than a scheduling hiccup."""
    serve = _serve(world, "timing")
    try:
        paths = [f"/buildid/{world['bid']}/section/.debug_info", f"/buildid/{UNKNOWN_BID}/section/.debug_info"] * 100
        answers = _fetch(attacker, f"127.0.0.1:{serve.port}", "GET", paths)
    finally:
        serve.stop()
    private = statistics.median(a["elapsed_s"] for a in answers[0::2])
    unknown = statistics.median(a["elapsed_s"] for a in answers[1::2])
    print(f"\nanswer time, median of 100 each: private {private * 1e3:.3f} ms, unknown {unknown * 1e3:.3f} ms")
    assert {a["status"] for a in answers} == {404}
    assert abs(private - unknown) < 0.005, (private, unknown)


def test_debuginfod_find_without_rights_sees_not_found(world, attacker, public_tmp_factory):
    """The real elfutils client, run as the attacker: the private build-id fails exactly as an unknown one.
    (elfutils 0.188 reports every HTTP error as ENOENT, 403 included: what serve answered it is read from
    /metrics, as root on the unix socket: 404 each time, never 403.)"""
    serve = _serve(world, "find", sock=True)
    cache = public_tmp_factory("buildidd-pv-cache-")
    os.chown(cache, attacker[0], attacker[1])
    try:
        runs = {}
        for name, bid in (("private", world["bid"]), ("unknown", UNKNOWN_BID), ("private-key", world["key"]),
                          ("unknown-key", UNKNOWN_KEY)):
            for kind in ("executable", "debuginfo"):
                r = as_user(attacker, ["env", f"DEBUGINFOD_URLS={serve.url}", f"DEBUGINFOD_CACHE_PATH={cache}/{name}",
                                       "debuginfod-find", kind, bid], timeout=60)
                runs[(name, kind)] = (r.returncode, r.stdout, r.stderr.replace(bid, "ID"))
        status, _, text = request_unix(world["sock_dir"] / "find.sock", "GET", "/metrics")
    finally:
        serve.stop()
    for kind in ("executable", "debuginfo"):
        assert runs[("private", kind)] == runs[("unknown", kind)] == runs[("private-key", kind)] \
            == runs[("unknown-key", kind)], runs
        code, out, err = runs[("private", kind)]
        assert code != 0 and out == "" and "No such file or directory" in err, runs[("private", kind)]
    answered = {dict(labels)["status"]: n for (name, labels), n in samples(text).items()
                if name == "buildidd_serve_requests_total" and dict(labels)["route"] == "/buildid/{build_id}/{artifact}"}
    assert answered == {"404": 8}, answered


def test_metrics_need_rights_unless_made_public(world, attacker):
    """/metrics: refused (403, counted) to the attacker over TCP and the unix socket, answered to root on the
    unix socket; with a token, 401 without it and 200 with it; serve_metrics_public opens it to everyone
    (with a token set, /metrics alone: the lookups still need it)."""
    closed = _serve(world, "metrics", sock=True)
    token = _serve(world, "metrics-token", "--token-file", str(world["tmp"] / "token"))
    public = _serve(world, "metrics-public", "--config", str(world["tmp"] / "public-metrics.toml"))
    both = _serve(world, "metrics-both", "--config", str(world["tmp"] / "public-metrics.toml"),
                  "--token-file", str(world["tmp"] / "token"))
    sock = str(world["sock_dir"] / "metrics.sock")
    try:
        [tcp] = _fetch(attacker, f"127.0.0.1:{closed.port}", "GET", ["/metrics"])
        [unix] = _fetch(attacker, sock, "GET", ["/metrics"])
        assert tcp["status"] == unix["status"] == 403 and "bearer token" in tcp["body"], (tcp, unix)
        assert "buildidd_serve" not in tcp["body"]
        assert request(closed.url, "GET", "/metrics")[0] == 403            # root over TCP: no rights either
        status, _, text = request_unix(sock, "GET", "/metrics")
        assert status == 200 and value(text, "buildidd_serve_refused_total", reason="metrics_forbidden") == 3, text
        [no_token] = _fetch(attacker, f"127.0.0.1:{token.port}", "GET", ["/metrics"])
        assert no_token["status"] == 401
        assert request(token.url, "GET", "/metrics", AUTH)[0] == 200
        [open_] = _fetch(attacker, f"127.0.0.1:{public.port}", "GET", ["/metrics"])
        assert open_["status"] == 200 and "buildidd_serve_requests_total" in open_["body"]
        metrics, lookup = _fetch(attacker, f"127.0.0.1:{both.port}", "GET",
                                 ["/metrics", f"/buildid/{world['public']}/executable"])
        assert metrics["status"] == 200 and lookup["status"] == 401
    finally:
        for s in (closed, token, public, both):
            s.stop()
