"""Build of the C part of buildidd (the fast path: daemon/buildidd/capture/_fastpath.c and fastpath/);
metadata is in pyproject.toml."""

from setuptools import Extension, setup

FASTPATH = "daemon/buildidd/capture/"

setup(ext_modules=[Extension(
    "buildidd.capture._fastpath",
    sources=[FASTPATH + "_fastpath.c", FASTPATH + "fastpath/rings.c", FASTPATH + "fastpath/templates.c",
             FASTPATH + "fastpath/records.c", FASTPATH + "fastpath/batch.c",
             FASTPATH + "fastpath/linebuf.c"],
    include_dirs=["bpf"], depends=["bpf/events.h", FASTPATH + "fastpath/fastpath.h"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Wno-unused-parameter"])])
