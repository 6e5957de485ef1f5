"""Shared fixtures: gcc-built ELF files, BPF availability, a recorder factory.

Tests that need root and a loadable BPF program use the ``bpf`` fixture: they
skip when BPF is unavailable, and fail instead under BUILDIDD_REQUIRE_BPF=1 (CI).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buildidd.fsio import remove_tree  # noqa: F401 - tests import it from here

#: scripts/ holds what tests and benchmarks share: the perf oracle (perfcompare.py).
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

REQUIRE_BPF = os.environ.get("BUILDIDD_REQUIRE_BPF") == "1"


@pytest.fixture(autouse=True)
def _no_perf_left_running():
    """A test that failed before stopping its PerfRecorder leaves neither perf running nor the host's
    perf record lock taken (the next test's perf would wait for it)."""
    yield
    import perfcompare
    perfcompare.finish_all()


def need(condition: bool, why: str) -> None:
    """Skip (or fail under BUILDIDD_REQUIRE_BPF=1) when condition is false."""
    if not condition:
        if REQUIRE_BPF:
            pytest.fail(f"required for BPF tests: {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def bpf():
    """Asserts that this process can load and attach buildidd's BPF programs."""
    need(os.geteuid() == 0, "needs root")
    need(os.path.exists("/sys/kernel/btf/vmlinux"), "needs kernel BTF")
    try:
        import bcc  # noqa: F401
    except ImportError:
        need(False, "BCC (python3-bpfcc) not importable")
    return True


def gcc(src: str, out: Path, *flags: str) -> Path:
    """Compile C source text to out with gcc; returns out. Fails the test on a compiler error."""
    c = out.with_suffix(out.suffix + ".c") if out.suffix else out.with_name(out.name + ".c")
    c.write_text(src)
    r = subprocess.run(["gcc", "-O1", "-o", str(out), str(c), *flags], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def readelf_build_id(path: str | os.PathLike) -> str | None:
    """The build-id `readelf -n` reports for path (lower-case hex), or None."""
    r = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True)
    m = re.search(r"Build ID:\s*([0-9a-fA-F]+)", r.stdout)
    return m.group(1).lower() if m else None


@pytest.fixture
def recorder(bpf, tmp_path):
    """Factory: a started host-mode Recorder writing under tmp_path; closed at teardown."""
    from buildidd.config import Config
    from buildidd.capture.recorder import Recorder

    made = []

    def make(**overrides):
        follow = overrides.pop("follow", False)
        overrides.setdefault("store_root", "")     # snapshots only where a test asks for them
        cfg = Config(session_root=str(tmp_path / "sessions")).replace(**overrides)
        rec = Recorder(cfg, follow=follow)
        rec.start()
        made.append(rec)
        return rec

    yield make
    for rec in made:
        rec.close()


def session_records(session_dir) -> list[dict]:
    from buildidd.sessionlog import read_session

    return list(read_session(session_dir))


def recorded_exec(rec, argv: list[str], timeout_s: float = 10.0) -> list[dict]:
    """Run argv, step the Recorder rec until its session holds the exec record of argv[0]
    (as filename) or timeout_s passes; those records (empty: none came)."""
    import time

    subprocess.run(argv, check=True)
    deadline = time.monotonic() + timeout_s
    seen: list[dict] = []
    while time.monotonic() < deadline and not seen:
        rec.step()
        seen = [r for r in session_records(rec.session_dir)
                if r["type"] == "exec" and r.get("filename") == argv[0]]
        time.sleep(0.05)
    return seen


assert shutil.which("gcc"), "gcc is needed to build test inputs"


@pytest.fixture(scope="session")
def workloads(tmp_path_factory):
    """The C workloads of scripts/workloads, built with gcc for this test session."""
    from workloads import build
    return build.build(tmp_path_factory.mktemp("workloads"), n_libs=8)


class Background:
    """Runs Recorder.run in a thread until stop()."""

    def __init__(self, rec):
        import threading
        self.rec = rec
        self._stop = threading.Event()
        self.thread = threading.Thread(target=rec.run, args=(self._stop.is_set,), daemon=True)
        self.thread.start()

    def stop(self):
        self._stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_MNT_DETACH = 2


@pytest.fixture
def tmpfs_mount(tmp_path):
    """Factory: mount(size) mounts a tmpfs of that size ("256k", "1m") under tmp_path (a full disk
    on demand); skips on EPERM, fails under BUILDIDD_REQUIRE_BPF=1; unmounted at teardown."""
    mounted = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        if _libc.mount(b"tmpfs", bytes(mnt), b"tmpfs", 0, f"size={size},mode=0755".encode()) != 0:
            err = ctypes.get_errno()
            if err == errno.EPERM and not REQUIRE_BPF:
                pytest.skip("mounting a tmpfs needs CAP_SYS_ADMIN (EPERM)")
            pytest.fail(f"mount tmpfs on {mnt}: {os.strerror(err)}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        if _libc.umount2(bytes(mnt), _MNT_DETACH) != 0:
            raise OSError(ctypes.get_errno(), f"umount {mnt}")


ATTACKER_NAME = "buildidd-test-attacker"
BYSTANDER_NAME = "buildidd-test-bystander"


def _test_user(name: str) -> tuple[int, int, str]:
    """(uid, gid, name) of the unprivileged user name, made with ``useradd -M -r`` (no home, system
    account) when absent and kept (test sessions running at the same time share it)."""
    import pwd
    need(os.geteuid() == 0, "making a test user needs root")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        r = subprocess.run(["useradd", "-M", "-r", "-s", "/bin/sh", name], capture_output=True, text=True)
        if r.returncode != 0 and "already exists" not in r.stderr:
            pytest.fail(f"useradd {name}: {r.stderr}")
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid, name


@pytest.fixture(scope="session")
def attacker():
    """A real unprivileged user for hostile tests: (uid, gid, name).

    Needs root; skips otherwise (fails under BUILDIDD_REQUIRE_BPF=1).  Run
    commands as it with :func:`as_user`.
    """
    return _test_user(ATTACKER_NAME)


@pytest.fixture(scope="session")
def bystander():
    """A second real unprivileged user, whose work an attacker's flood must not cost: (uid, gid, name)."""
    return _test_user(BYSTANDER_NAME)


ROOT = Path(__file__).resolve().parent.parent
_PUBLIC: dict[str, Path] = {}


def _public_dir(prefix: str) -> Path:
    """A new 0755 directory under /tmp, removed when the test session ends."""
    import atexit
    import tempfile
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(d, 0o755)
    atexit.register(shutil.rmtree, d, True)
    return d


def _copy_public(src: Path, dst: Path, ignore=None) -> None:
    """copytree that hard-links files where it can (same file system), then makes dst readable by all."""
    def link_or_copy(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)
    shutil.copytree(src, dst, symlinks=True, ignore=ignore, copy_function=link_or_copy)
    _readable(dst)


def _readable(top: Path) -> None:
    """Every directory under top 0755, every file readable by all (modes otherwise kept)."""
    for d, dirs, files in os.walk(top):
        os.chmod(d, 0o755)
        for name in files:
            f = os.path.join(d, name)
            if not os.path.islink(f):
                os.chmod(f, os.stat(f).st_mode | 0o444)


def public_checkout() -> Path:
    """A copy of this checkout's sources (no .venv, .git, build products) that every user can read.

    The checkout may lie under a directory only its owner can enter (``mktemp -d``, a 0700 home):
    what a test runs as another user (scripts/install as nobody) is staged here once per test session.
    """
    if "checkout" not in _PUBLIC:
        dst = _public_dir("buildidd-public-src-") / "buildidd"
        _copy_public(ROOT, dst, shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                       ".pytest_cache", "*.so"))
        _PUBLIC["checkout"] = dst
    return _PUBLIC["checkout"]


def public_wheel() -> Path:
    """The buildidd wheel built once per test session from this checkout, readable by every user.

    Built as scripts/install builds one (``pip wheel --no-deps --no-build-isolation`` on a copy of the
    sources, no tests); the install tests hand it to scripts/install through BUILDIDD_WHEEL and install
    it into fresh venvs, so each of them installs what the checkout builds without building it again.
    """
    if "wheel" not in _PUBLIC:
        import tempfile
        out = _public_dir("buildidd-public-wheel-")
        with tempfile.TemporaryDirectory(prefix="buildidd-wheel-src-") as tmp:
            src = Path(tmp) / "buildidd"
            shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
                ".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache", "*.so", "tests"))
            r = subprocess.run([sys.executable, "-m", "pip", "-q", "--no-cache-dir", "wheel", "--no-deps",
                                "--no-build-isolation", "-w", str(out), str(src)],
                               capture_output=True, text=True, env={**os.environ, "PIP_NO_INDEX": "1"})
        assert r.returncode == 0, r.stdout + r.stderr
        (wheel,) = out.glob("buildidd-*.whl")
        _readable(out)
        _PUBLIC["wheel"] = wheel
    return _PUBLIC["wheel"]


def offline_pip_env() -> dict[str, str]:
    """Environment for a pip run that installs buildidd's dependencies offline, from a wheelhouse
    downloaded once per test session: ``PIP_NO_INDEX`` and ``PIP_FIND_LINKS``.

    The wheelhouse holds pyproject's dependencies (and theirs) as wheels, systemd-python left out
    (Debian's python3-systemd serves it through --system-site-packages), made by ``pip wheel`` from
    pip's cache that scripts/setup filled (a dependency published as an sdist only is built once here).  The install tests that check what scripts/install
    renders and stages use it, so each install's venv costs no downloads; test_install's first install
    fetches from the index as an operator's does.
    """
    if "wheelhouse" not in _PUBLIC:
        import tomllib
        out = _public_dir("buildidd-wheelhouse-")
        deps = [d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                if not d.startswith("systemd-python")]
        r = subprocess.run([sys.executable, "-m", "pip", "-q", "wheel", "-w", str(out), *deps],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        _readable(out)
        _PUBLIC["wheelhouse"] = out
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(_PUBLIC["wheelhouse"])}


@pytest.fixture(scope="session")
def buildidd_wheel() -> Path:
    """public_wheel(): one buildidd wheel per test session (see there)."""
    return public_wheel()


def public_python() -> str:
    """A Python interpreter every user can run that imports this checkout's buildidd and its dependencies.

    The dev venv (.venv/bin/python) and daemon/ may be unreachable to other users (a checkout under a 0700
    directory).  Staged once per test session in a 0755 directory under /tmp: a venv made from the same
    interpreter (--system-site-packages, for bcc and systemd; no pip) whose site-packages holds a .pth
    naming copies of the package (the C fast path included) and of the dev venv's dependencies.
    """
    if "python" not in _PUBLIC:
        import sysconfig
        base = _public_dir("buildidd-public-py-")
        _copy_public(ROOT / "daemon" / "buildidd", base / "daemon" / "buildidd",
                     shutil.ignore_patterns("__pycache__"))
        _copy_public(ROOT / "bpf", base / "daemon" / "buildidd" / "bpf", shutil.ignore_patterns("__pycache__"))
        _copy_public(Path(sysconfig.get_paths()["purelib"]), base / "site",
                     shutil.ignore_patterns("__pycache__", "__editable__*", "buildidd*", "_buildidd*"))
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
                        "--system-site-packages", str(base / "venv")], check=True)
        py = base / "venv" / "bin" / "python"
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        Path(site, "buildidd-public.pth").write_text(f"{base / 'daemon'}\n{base / 'site'}\n")
        _readable(base / "venv")
        _PUBLIC["python"] = py
    return str(_PUBLIC["python"])


def _public_argv(argv: list[str]) -> list[str]:
    """argv with this test run's Python (sys.executable) replaced by :func:`public_python`."""
    return [public_python(), *argv[1:]] if argv and argv[0] == sys.executable else list(argv)


def as_user(user, argv: list[str], **kw) -> subprocess.CompletedProcess:
    """Run argv as user ((uid, gid, name) from the ``attacker`` fixture) with no supplementary groups.

    setpriv drops to the user's uid/gid (and clears groups) before exec; an argv that starts with
    sys.executable runs :func:`public_python` instead (the user may not reach this checkout), in /
    unless cwd is given; keyword arguments go to subprocess.run (default: capture_output, text).
    """
    uid, gid, _ = user
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    kw.setdefault("cwd", "/")
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
                           *_public_argv(argv)], **kw)


def as_user_popen(user, argv: list[str], **kw) -> subprocess.Popen:
    """:func:`as_user` as a background process (subprocess.Popen)."""
    uid, gid, _ = user
    kw.setdefault("cwd", "/")
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
                             *_public_argv(argv)], **kw)


def store_add(store, path: Path, name: str | None = None) -> str:
    """Add the ELF file at path to a buildidd Store (as ``name``, default its path); returns its build-id."""
    bid = readelf_build_id(path)
    assert bid, f"{path} has no build-id"
    fd = os.open(path, os.O_RDONLY)
    try:
        store.add_from_fd(fd, str(path) if name is None else name, bid)
    finally:
        os.close(fd)
    return bid


def fill_disk(path: Path) -> None:
    """Write to path (a file, appended to) until its file system is full (ENOSPC; any other error raises)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for block in (4096, 1):
            while True:
                try:
                    os.write(fd, b"f" * block)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)


def split_debuginfo(binary: Path, debug_root: Path) -> Path:
    """Move binary's debuginfo to debug_root/.build-id/xx/rest.debug and strip it (as distributions ship);
    returns the debuginfo's path."""
    bid = readelf_build_id(binary)
    debug = debug_root / ".build-id" / bid[:2] / (bid[2:] + ".debug")
    debug.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(binary), str(debug)], check=True)
    subprocess.run(["strip", "-s", str(binary)], check=True)
    return debug


def upgrade_by_rename(built: Path, dest: Path) -> None:
    """Put built at dest as a package manager does: a copy under a temporary name, then rename(2) over dest
    (the old inode lives on in the processes that run it)."""
    tmp = dest.with_name(dest.name + ".new")
    shutil.copyfile(built, tmp)
    os.chmod(tmp, 0o755)
    os.rename(tmp, dest)


def wait_exec(p: subprocess.Popen, path: str | os.PathLike, timeout_s: float = 10.0) -> subprocess.Popen:
    """Wait until process p runs path (its /proc/PID/exe; a hang bound of timeout_s); returns p.

    Raises:
        AssertionError: it did not within timeout_s.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{p.pid}/exe").startswith(str(path)):
                return p
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"pid {p.pid} did not exec {path} within {timeout_s} s")


def free_port(below: int | None = None) -> int:
    """A loopback TCP port (int) free now, for a server a test starts and names its port to.

    Chosen below the kernel's ephemeral range (net.ipv4.ip_local_port_range) and at random: a port the
    kernel handed out (bind to port 0) can be taken again, between this call and the server's bind, as the
    source port of any outgoing connection on the host (a bench beside the suite, the server's own
    first components); a port below that range is only ever taken by an explicit bind.

    Args:
        below: an upper bound (exclusive) as well, for a server that derives ports from the one given.

    Raises:
        AssertionError: no free port found in 1000 tries.
    """
    import random
    import socket
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = min(low, below or low)
    for _ in range(1000):
        port = random.randrange(10000, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free loopback port in [10000, {top})")


@pytest.fixture(scope="session")
def public_tmp_factory():
    """Factory ``make(prefix) -> Path``: a new 0755 directory under /tmp that every user can traverse, so that
    files built there are not private to the store (tmp_path lies under pytest's 0700 directory); removed at the end."""
    import tempfile
    made = []

    def make(prefix: str = "buildidd-public-") -> Path:
        d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        os.chmod(d, 0o755)
        made.append(d)
        return d

    yield make
    for d in made:
        remove_tree(d)


class ServeProcess:
    """``buildidd serve`` as a subprocess on a free loopback port (``--listen HOST:0``).

    ``url`` is its base URL once it listens; ``stop()`` terminates it and
    returns its log (stderr, written to a file so that a full pipe never blocks it).
    """

    def __init__(self, store_root, log_path: Path, *extra: str, session_root=None, host: str = "127.0.0.1",
                 user: int | None = None, group: int | None = None, wrapper: tuple[str, ...] = ()):
        py = sys.executable if user is None else public_python()     # another user may not reach this checkout
        cmd = [*wrapper, py, "-m", "buildidd.cli", "serve", "--listen", f"{host}:0",
               "--store-root", str(store_root), "--session-root", str(session_root or log_path.with_suffix(".sessions")),
               "--socket", "", *extra]
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, user=user, group=group,
                                         cwd=None if user is None else "/")
        line = self.proc.stdout.readline()
        m = re.match(r"listening on (https?)://(\S+):(\d+)", line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"buildidd serve did not start: {line!r}\n{log_path.read_text()}")
        self.port = int(m.group(3))
        self.url = f"{m.group(1)}://{m.group(2)}:{self.port}"

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.log_path.read_text()
