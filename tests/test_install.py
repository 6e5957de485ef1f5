"""A plain (non-editable) ``pip install .`` works: the BPF sources travel as package data.

The package is installed into a fresh venv made from /usr/bin/python3 with
--system-site-packages (so that Debian's bcc imports, as in scripts/setup); its
pure-Python dependencies are taken from the project's .venv through a .pth line
(no network).  Then ``buildidd --version`` runs from that venv, and the BPF
program compiles and loads from the installed copy of bpf/ (not the checkout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pip_install_non_editable_runs_and_loads_bpf_from_the_installed_package(bpf, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The project's own dependencies (pyelftools, psutil, zstandard ...) from the dev venv.
    Path(site, "_buildidd_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    build = tmp_path / "src"   # the working tree as it is, without the dev venv and built files
    shutil.copytree(ROOT, build, ignore=shutil.ignore_patterns(".git", ".venv", "*.so", "*.egg-info", "build",
                                                               "__pycache__", ".pytest_cache"))
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(build)],
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
