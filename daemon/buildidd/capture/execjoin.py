"""The exec join: an exec record waits for its executable's mapping.

The kernel sends an EXEC event (the filename as passed to execve, the
executable's identity) and, right after from the same tid, the mappings that
execve made (origin "exec" for the main executable).  The exec's line carries
the executable's build-id, so it is written when that mapping's identity is
resolved (one resolution for both), or, when the mapping does not follow
within one more step (dropped, or not found), resolved from the exec record
itself.  The C fast path holds and completes execs the same way, in the same
table (Tables.held, tid -> HeldExec).
"""

from __future__ import annotations

from buildidd.capture.tables import HeldExec, Stats, Tables
from buildidd.kernel.events import ExecHead, RawEvent, decode, exec_file_key, file_key
from buildidd.resolve.enrich import Enricher, Resolution
from buildidd.sessionlog.records import exec_line, exec_prefix


class ExecJoin:
    """Holds exec records in tables.held until their executable's mapping completes them.

    Args:
        tables: the recorder's Tables (held, live, lines, step).
        enricher: resolves an exec's executable when no mapping completes it.
        stats: counts the exec records written.
    """

    def __init__(self, tables: Tables, enricher: Enricher, stats: Stats):
        self.tables = tables
        self.enricher = enricher
        self.stats = stats

    def hold(self, raw: bytes, head: ExecHead) -> None:
        """Hold an exec (raw EXEC record, head = exec_head(raw)) until its tid's next mapping.

        An exec the tid already held is written first, resolved from its own
        record.  The line's prefix is made now; the identity stays raw (the
        key) until a fallback needs it decoded.  The pid's live mappings are
        gone with its old image.
        """
        held = self.tables.held
        prev = held.pop(head.tid, None)
        if prev is not None:
            self.write(prev, None)
        held[head.tid] = HeldExec((raw, self.tables.step, exec_file_key(raw), exec_prefix(head)))
        self.tables.drop_live(head.pid)

    def complete(self, ev: RawEvent, res: Resolution) -> None:
        """A mapping (decoded, resolved to res) from ev.tid: write the exec that tid holds, if any.

        Its executable's build-id is res when the mapping is of that same
        file; otherwise the exec is resolved from its own record.
        """
        held = self.tables.held.pop(ev.tid, None)
        if held is not None:
            self.write(held, res if held.key == file_key(ev.identity) else None)

    def write(self, held: HeldExec, res: Resolution | None) -> None:
        """Write a held exec's line with its executable's Resolution (None: resolved from the exec record)."""
        if res is None:
            res = self.enricher.resolve(decode(held.record))     # exec_head checked what decode checks
        self.stats.count("exec")
        self.tables.emit(exec_line(held.prefix, res))

    def release(self, everything: bool = False) -> None:
        """End a step: write the execs whose mapping did not come within one more step (or all of them)."""
        tables = self.tables
        tables.step += 1
        for tid, held in list(tables.held.items()):
            if everything or held.step < tables.step - 1:
                del tables.held[tid]
                try:
                    self.write(held, None)
                except Exception as e:      # one exec's failure stops no other record
                    self.stats.event_error(e)
