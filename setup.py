"""Build of the C part of buildidd (daemon/buildidd/_fastpath.c); metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "buildidd._fastpath", sources=["daemon/buildidd/_fastpath.c"], include_dirs=["bpf"],
    depends=["bpf/events.h"], extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                        "-Wno-unused-parameter"])])
