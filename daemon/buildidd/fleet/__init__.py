"""fleet: the store and the sessions pushed to an S3-compatible bucket, and read back from it.

Every host's binaries and sessions in one durable place that outlives the
host, laid out in debuginfod's URL space so that any debuginfod client reads
the bucket's HTTP front directly (``DEBUGINFOD_URLS=<endpoint>/<bucket>/<prefix>``)::

    store entries ──► keys (layout, metadata) ──► bucket (S3 client) ◄── ledger (what the bucket holds)
    closed segments ─┘          push (one pass) ─┘     service (the loop: backoff, SIGTERM budget)

One module per concern: keys (object keys and metadata), bucket (the S3
client: requests, parts, errors by cause, bandwidth), ledger (the local
memory of what was checked and pushed, and the counters), binaries (one
store entry → its objects, with the trust rules), sessions (closed
segments and the session manifest), push (a pass over the store and the
sessions, and the status) and service (the loop of buildidd-push.service).
fetch reads a gone host's sessions back (``buildidd fleet sessions`` and ``fleet pull``).

This is the only stage with network code (boto3); it runs in its own process
and unit, never in the recording daemon (a forbidden-import contract in
pyproject.toml says so).

May import: offline and the stages below it, and the shared modules; never cli.
"""
