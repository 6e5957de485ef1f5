"""resolve: from a mapping to the build-id of the exact file that was mapped.

File identity checks and /proc access (procfs: map_files, proc root), the
bounded ELF note reader and the BuildId value type (buildid), a request and
its answer (resolution), the routes to a mapped file that the workers run
(routes), the enricher and its one bounded identity cache (enrich), the
hand-over of a file the kernel read (handover) and its queue (handoverqueue),
the htlhashes hand-overs compute (filekeys), the exec pins (execpins, with
pinledger, pininbox, execuids, fanotify), the queues that charge each job to
a uid and serve uids in turn (fairqueue), and host facts such as the running
kernel's build-id (host).

May import: kernel, and the shared modules.
"""
