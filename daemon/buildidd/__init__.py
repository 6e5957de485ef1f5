"""buildidd: record every executable file mapping with the exact build-id.

The package is the pipeline, one subpackage per stage; data flows one way,
top to bottom in the diagram, and a stage imports only from the stages above
it, the earlier ones (checked by import-linter, contract in pyproject.toml,
run by tests/test_layers.py)::

    kernel      BTF offsets, the BPF loader (BCC), the wire structs of bpf/events.h
      │  raw ring-buffer records (map, exec, fork, exit, comm)
    resolve     mapping → file identity → GNU build-id (ELF note reader, /proc, enricher)
      │  Resolution (build-id hex or the reason there is none)
    sessionlog  records and their JSON lines; segments, rotation, compression, reading
    store       perf's build-id cache: verified copies of binaries, debuginfo, kallsyms
      │  (sessionlog and store are siblings: neither imports the other)
    capture     the recorder loop and its C fast path: drain, join, record, recover
      │
    control     the control socket (status, rotate, lookup)
    offline     archive, import, serve, pull, resolve, export (away from the host)
    fleet       push the store and sessions to an S3-compatible bucket (the only network client)
    cli         argparse entry points: ``buildidd.cli:main``

Shared value modules, importable from every stage: config (the one Config and
its defaults), errors (BuildiddError and its subclasses), clock (boot time ↔
wall clock), memo (bounded caches with counters).

Vocabulary: a *mapping* is one VMA of a file (vm_start, len, pgoff), a *DSO*
the file mapped, its *identity* (dev, inode, i_generation, size, mtime) the
kernel's view of that inode when it was mapped; ``pid`` means tgid and ``tid``
the thread; times are ns since boot (CLOCK_BOOTTIME) unless named ``*_wall``.
"""

__version__ = "0.1.0"
