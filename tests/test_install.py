"""A plain (non-editable) ``pip install .`` works: the BPF sources travel as package data.

The wheel the checkout builds (one per test session, tests/conftest.py public_wheel(), built by
``pip wheel`` as ``pip install .`` builds one) is installed into a fresh venv made from
/usr/bin/python3 with --system-site-packages (so that Debian's bcc imports, as in scripts/setup); its
pure-Python dependencies are taken from the project's .venv through a .pth line (no network).  Then ``buildidd --version`` runs from that venv, and the BPF
program compiles and loads from the installed copy of bpf/ (not the checkout).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import offline_pip_env, public_wheel

ROOT = Path(__file__).resolve().parent.parent


def test_pip_install_non_editable_runs_and_loads_bpf_from_the_installed_package(bpf, buildidd_wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The project's own dependencies (pyelftools, psutil, zstandard ...) from the dev venv.
    Path(site, "_buildidd_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(buildidd_wheel)],
                       capture_output=True, text=True, env={**os.environ, "PIP_NO_INDEX": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(p.name.startswith("__editable__") for p in Path(site).iterdir())

    r = subprocess.run([str(venv / "bin" / "buildidd"), "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("buildidd "), r.stdout + r.stderr

    probe = ("import os, buildidd.kernel.events as ev\n"
             "from buildidd.kernel.tracer import Tracer\n"
             "from buildidd.config import Config\n"
             "print(ev.BPF_DIR)\n"
             "t = Tracer(ring_bytes=Config().ring_bytes)\n"
             "print('loaded', len(t.ring_maps))\n"
             "t.close()\n")
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    bpf_dir, loaded = r.stdout.split("\n")[:2]
    assert Path(bpf_dir).resolve().is_relative_to(Path(site).resolve()), bpf_dir
    assert (Path(bpf_dir) / "buildidd.bpf.c").is_file() and (Path(bpf_dir) / "events.h").is_file()
    assert loaded.startswith("loaded ") and int(loaded.split()[1]) >= 1
    assert sys.executable != str(py)


def _install(dest: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """DESTDIR=dest scripts/install args, installing the session's wheel (BUILDIDD_WHEEL) and its dependencies
    from the session's wheelhouse (conftest.offline_pip_env), unless env names a wheel or none."""
    offline = offline_pip_env() if env.get("BUILDIDD_WHEEL", "-") else {}
    return subprocess.run([str(ROOT / "scripts" / "install"), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DESTDIR": str(dest), "BUILDIDD_WHEEL": str(public_wheel()), **offline,
                               **env})


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink())


def test_install_into_its_own_prefix_upgrades_in_place_and_uninstalls(tmp_path):
    """buildidd lands in PREFIX's own venv (outside the clone), BINDIR/buildidd links to it and runs from
    anywhere without the clone; a second install reuses the venv and replaces buildidd's files; uninstall
    removes every file install added, and keeps a configuration the operator changed."""
    dest = tmp_path / "root"
    # The first install builds its own wheel from the clone (no BUILDIDD_WHEEL: the default); the others
    # install the session's.
    r = _install(dest, PREFIX="/opt/bid", BINDIR="/usr/bin", BUILDIDD_WHEEL="")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("install: staged under {0} (buildidd in /opt/bid, /usr/bin/buildidd, units, configuration, "
                        "man page); nothing started\n".format(dest))
    venv = dest / "opt/bid/venv"
    assert os.readlink(dest / "usr/bin/buildidd") == "/opt/bid/venv/bin/buildidd"
    unit = (dest / "etc/systemd/system/buildidd.service").read_text()
    assert "\nExecStart=/opt/bid/venv/bin/buildidd run --config /etc/buildidd/buildidd.toml\n" in unit
    assert "Documentation=file:///opt/bid/README.md" in unit and str(ROOT) not in unit
    # Issue 43: the header comment reads as written, no placeholder left in it or anywhere.
    for rendered in (unit, (dest / "etc/systemd/system/buildidd-serve.service").read_text()):
        assert not re.search(r"@[A-Z][A-Z_]*@", rendered) and "#@" not in rendered, rendered[:800]
    assert unit.startswith("# buildidd as a systemd service, installed by scripts/install from "
                           "systemd/buildidd.service.in:\n# buildidd in /opt/bid (its venv: /opt/bid/venv), "
                           "configured by /etc/buildidd/buildidd.toml.\n"), unit[:400]
    assert "\nExecStart=/opt/bid/venv/bin/buildidd serve " in (dest / "etc/systemd/system/buildidd-serve.service").read_text()
    push = (dest / "etc/systemd/system/buildidd-push.service").read_text()
    assert "\nExecStart=/opt/bid/venv/bin/buildidd push --service --config /etc/buildidd/buildidd.toml\n" in push
    assert "\nCapabilityBoundingSet=\n" in push and "AF_INET" in push     # network, no capability
    # It runs from the staged venv, importing buildidd from there (not from the clone), in a directory
    # where the clone is not on any path.
    r = subprocess.run([str(venv / "bin/python"), "-c", "import buildidd, sys; print(buildidd.__file__)"],
                       capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and Path(r.stdout.strip()).is_relative_to(venv), r.stdout + r.stderr
    installed = Path(r.stdout.strip()).parent
    # An upgrade in place: the same venv, buildidd's files replaced by the clone's.
    (venv / "mark").write_text("the venv of the first install")
    (installed / "inputs.py").write_text("# an older buildidd\n")
    r = _install(dest, PREFIX="/opt/bid", BINDIR="/usr/bin")
    assert r.returncode == 0, r.stderr
    assert (venv / "mark").read_text() == "the venv of the first install"
    assert (installed / "inputs.py").read_text() == (ROOT / "daemon/buildidd/inputs.py").read_text()
    r = subprocess.run([str(venv / "bin/python"), "-m", "buildidd.cli", "--version"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("buildidd ")
    # Uninstall: what install added is gone; a changed configuration stays, and is named.
    (dest / "etc/buildidd/buildidd.toml").write_text('store_quota_bytes = "1G"\n')
    r = _install(dest, "--uninstall", PREFIX="/opt/bid", BINDIR="/usr/bin")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (f"install: removed buildidd from {dest}/opt/bid and its units, link, man page\n"
                        "install: kept /etc/buildidd/buildidd.toml (changed since install)\n")
    assert _files(dest) == ["etc/buildidd/buildidd.toml"]
    r = _install(dest, "--uninstall", PREFIX="/opt/bid")
    assert r.returncode == 1 and r.stderr == (f"install: nothing to uninstall: {dest}/opt/bid/installed-files missing "
                                              "(not installed with this PREFIX?)\n")


def test_install_refuses_a_prefix_inside_the_clone_and_unknown_arguments(tmp_path):
    r = _install(tmp_path, PREFIX=str(ROOT / "inst"))
    assert r.returncode == 2 and r.stderr == (f"install: PREFIX {ROOT}/inst lies inside this clone; choose a place "
                                              "of its own\n")
    r = _install(tmp_path, "--frobnicate")
    assert r.returncode == 2 and r.stderr == "install: unknown argument '--frobnicate' (none, or --uninstall)\n"
    r = _install(tmp_path / "root", BUILDIDD_WHEEL=str(tmp_path / "none.whl"))
    assert r.returncode == 2 and r.stderr == f"install: BUILDIDD_WHEEL {tmp_path}/none.whl is not a file\n"
    assert not any(tmp_path.iterdir())
