"""Build of the C part of buildidd (daemon/buildidd/capture/_fastpath.c); metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "buildidd.capture._fastpath", sources=["daemon/buildidd/capture/_fastpath.c"], include_dirs=["bpf"],
    depends=["bpf/events.h"], extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                        "-Wno-unused-parameter"])])
