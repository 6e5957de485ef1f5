"""store: the build-id store, laid out as perf's build-id cache (~/.debug).

``.build-id/xx/rest`` relative links to ``<path>/<build-id>/elf`` (plus
``debug``, ``probes``, kallsyms and modules for the kernel), filled by atomic,
verified copies; a quota; and the snapshotter that copies each binary the
first time its build-id is seen.

May import: resolve, kernel, and the shared modules; never sessionlog.

The names below are the store's public API (other stages import them from
``buildidd.store``, never from its modules).
"""

from buildidd.store.store import (BUILD_ID_DIR, DEBUG_NAME, ELF_NAME, KALLSYMS_DSO, KALLSYMS_NAME, MODULES_NAME,
                                  PROBES_NAME, VDSO_NAME, AddResult, Entry, Store)

__all__ = ["BUILD_ID_DIR", "DEBUG_NAME", "ELF_NAME", "KALLSYMS_DSO", "KALLSYMS_NAME", "MODULES_NAME",
           "PROBES_NAME", "VDSO_NAME", "AddResult", "Entry", "Store"]
