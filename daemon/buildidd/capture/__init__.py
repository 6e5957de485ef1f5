"""capture: the recording loop.

Drains the kernel's rings (rings), joins exec events with their executable's
mapping, records through the C fast path (_fastpath.c) or the Python path,
recovers from losses by rescanning /proc, paces itself, and drives
housekeeping (store quota, session retention).

May import: store, sessionlog, resolve, kernel, and the shared modules.
"""
