"""capture: the recording loop.

Starts the BPF side (bpfstart: the programs, the Tracer, the page-cache
check), drains the kernel's rings (rings), joins exec events with their
executable's mapping (execjoin), records through the C fast path
(_fastpath.c and fastpath/) or the Python path (slowpath), recovers from
losses by rescanning /proc (rescan), paces itself (pacing, loop), writes
(logsink), reports (report), and drives housekeeping (store quota, session
retention).  recorder.Recorder composes them; wiring builds a session's store
side (the store, the copy thread, the exec pins, the hand-over queue).

May import: store, sessionlog, resolve, kernel, and the shared modules.
"""
