"""buildidd(8), the manual page ``buildidd help-man`` prints: generated from the argument parser by
argparse-manpage, with the sections a parser does not hold (DESCRIPTION, EXIT STATUS, FILES, CONFIGURATION,
EXAMPLES, SEE ALSO) written here in roff."""

from __future__ import annotations

import argparse
import sys

from buildidd import __version__

__all__ = ["print_man", "DESCRIPTION", "EXAMPLES", "MAN_SECTIONS"]

DESCRIPTION = r"""\fBbuildidd\fR records every executable file mapping on a Linux host (each exec, each
\fBmmap\fR(2) of a file with execute permission, the ELF interpreter, every \fBdlopen\fR(3)'d library)
with the GNU build\-id of the exact file that was mapped, read at load time: by BPF from the page cache
where it can, else by user space under a strict identity check.  A build\-id that could not be read from
the very file mapped is never recorded; the record says why there is none.
.PP
It writes the history to a \fIsession\fR: a directory of JSON\-lines segments, zstd\-compressed once
closed (\fBbuildidd show\fR, \fBbuildidd sessions\fR).  Each binary it meets is copied, before an
upgrade can replace it, into a \fIstore\fR keyed by build\-id and laid out as perf's build\-id cache
(\fBperf \-\-buildid\-dir\fR).  A copy keeps its source's owner and mode; a file other users could
not read (in a 0700 directory, a memfd) stays private: it is neither archived nor served unless
\fBstore_share_private\fR says so.
.PP
\fBbuildidd run\fR is the daemon (the systemd unit runs it); \fBbuildidd record \-\- CMD\fR records one
command.  The other commands work on what was recorded, on the host or elsewhere:
\fBarchive\fR packs a session with every binary it names; \fBimport\fR and \fBpull\fR verify such an
archive and install it where perf and gdb look; \fBinject\fR gives a perf.data profile the exact build\-id of
every mapping; \fBresolve\fR, \fBwhich\fR and \fBbuildid\-list\fR answer which binary covered an address,
which build\-ids a path had, and what a session names; \fBserve\fR gives the store over the debuginfod protocol.
.PP
It runs as root and reads files any user controls: every path, file, archive and peer is treated as hostile,
and each cost is charged to the user who caused it."""

EXAMPLES = r"""Record this host until Ctrl\-C, then list the sessions and a process's mappings:
.PP
.nf
.RS
buildidd run
buildidd sessions
buildidd show latest \-\-type mmap \-\-pid 1234 \-\-since \-1h
.RE
.fi
.PP
Record one command and its children:
.PP
.nf
.RS
buildidd record \-\- python3 \-c 'import ssl'
.RE
.fi
.PP
On the host, archive the newest session with its binaries (mode 0600); on another machine, as any user,
import it into ~/.debug (which every offline verb then reads), read a profile taken during it with the
exact build\-ids (\fB\-\-buildid\-dir\fR is an option of \fBperf\fR itself, before the subcommand),
and open a core dumped on the host with gdb, its executable and debuginfo found by build\-id:
.PP
.nf
.RS
buildidd archive latest \-o host1.tar.zst
buildidd import host1.tar.zst
buildidd inject perf.data latest \-o perf.exact.data
perf \-\-buildid\-dir ~/.debug report \-i perf.exact.data
gdb \-iex 'set debug\-file\-directory ~/.debug/.gdb' \-c core
.RE
.fi
.PP
Which binary covered an address of process 1234 at the end of the session, with its symbol; every
build\-id a path had:
.PP
.nf
.RS
buildidd resolve latest 1234 7f3c75c44000 \-\-symbolize
buildidd which /usr/bin/python3.11
buildidd which \-\-glob '*/python3.11'
.RE
.fi
.PP
Serve the store to debuginfod clients, and fetch a host's sessions with a token:
.PP
.nf
.RS
buildidd serve \-\-listen 127.0.0.1:8002
DEBUGINFOD_URLS=http://127.0.0.1:8002 debuginfod\-find executable BUILDID
buildidd pull http://host1:8002 latest \-\-token\-file T
.RE
.fi"""


#: buildidd(8)'s sections after the commands and their options (roff), in man-pages(7) order.
MAN_SECTIONS = (
    ("exit status", """.TP
.B 0
success
.TP
.B 1
failure (one line on standard error naming the thing and the fix; \\fB\\-v\\fR adds the traceback)
.TP
.B 2
usage error: a bad option, address, size or time
.TP
.B 3
the daemon is not running (nothing listens on the control socket)
.TP
.B 4
permission denied: not root (the missing capability is named), not in the control group, or refused by a
serve (pull: HTTP 401 or 403, with the serve's reason)
.TP
.B record
the command's own status; 128+N when signal N ended it, 127 when it was not found, 126 when it could
not be executed"""),
    ("files", """.TP
.I /etc/buildidd/buildidd.toml
the configuration (see CONFIGURATION)
.TP
.I /var/lib/buildidd/sessions/
one directory per session: JSON-lines segments, zstd-compressed once closed
.TP
.I /var/lib/buildidd/store/
the build-id store, laid out as perf's build-id cache (perf \\-\\-buildid\\-dir)
.TP
.I /run/buildidd/control.sock
the control socket (status, rotate, lookup), mode 0660 root:buildidd
.TP
.I buildidd.service, buildidd-serve.service
the systemd units that scripts/install renders"""),
    ("configuration", """Every key of /etc/buildidd/buildidd.toml is optional; each is listed with its unit, default and
meaning in the shipped, commented file and in docs/configuration.md of the source.  Sizes take bytes
or K, M, G, T (powers of 1024); durations seconds or units as in systemd.time(7).  An unknown key is an
error that names it.  SIGHUP (systemctl reload buildidd) re-reads the file and rotates the segment."""),
    ("examples", EXAMPLES),
    ("see also", """.BR perf (1),
.BR perf\\-report (1),
.BR perf\\-inject (1),
.BR debuginfod (8),
.BR debuginfod\\-find (1),
.BR gdb (1),
.BR systemd.service (5),
.BR fanotify (7)"""),
)


def print_man(parser: argparse.ArgumentParser) -> int:
    """Write buildidd(8) in roff to stdout: DESCRIPTION, the parser's commands and options (argparse-manpage),
    then MAN_SECTIONS (the exit status is one of them, not the parser's epilog; EXAMPLES before SEE ALSO).
    Returns 0."""
    from argparse_manpage.manpage import Manpage
    data = {"manual_section": "8", "manual_title": "buildidd manual", "project_name": "buildidd", "version": __version__,
            "description": "record executable mappings with exact build-ids", "prog": "buildidd"}
    epilog, parser.epilog = parser.epilog, None
    description, parser.description = parser.description, None     # DESCRIPTION says more than the one line
    try:
        page = Manpage(parser, _data=data)
        page.add_section("description", "=", DESCRIPTION)
        for heading, content in MAN_SECTIONS:
            page.add_section(heading, "=", content)
        sys.stdout.write(str(page))
    finally:
        parser.epilog, parser.description = epilog, description
    return 0


