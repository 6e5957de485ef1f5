"""The BPF C sources (package data of buildidd, installed as ``buildidd.bpf``).

Not Python: this file only makes the directory a package so that
``importlib.resources.files("buildidd.bpf")`` finds ``buildidd.bpf.c`` and
``events.h`` both in a source checkout (editable install) and in an installed
wheel.  ``events.h`` is the one definition of the kernel→user wire format.
"""
