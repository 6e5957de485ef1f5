"""The exception hierarchy: BuildiddError and one subclass per kind of failure, each with its exit status.

Every error buildidd raises on purpose derives from :class:`BuildiddError`, so a
caller can tell our failures (with context) from bugs.  Set-up failures (a probe
that does not load, a bad configuration) stop the daemon before READY; per-event
failures are counted by the stage that met them and never stop the pipeline.
"""


class BuildiddError(Exception):
    """Base class of every error buildidd raises on purpose.

    Attributes:
        exit_code: the ``buildidd`` command's exit status when this error ends
            it (README "Exit codes"): 1 failure, 2 usage, 3 daemon not
            running, 4 permission denied.
    """

    exit_code = 1


class UsageError(BuildiddError):
    """A command-line argument is malformed (exit status 2, as argparse's)."""

    exit_code = 2


class NotRunningError(BuildiddError):
    """No daemon answers on the control socket (exit status 3, as ``systemctl status`` of an inactive unit)."""

    exit_code = 3


class PrivilegeError(BuildiddError):
    """The caller lacks a capability or a permission the command needs (exit status 4)."""

    exit_code = 4


class ConfigError(BuildiddError):
    """The configuration (file or command line) is invalid."""


class ProbeError(BuildiddError):
    """The kernel side cannot be set up: BTF missing a type, BPF load/attach failed."""


class BtfError(ProbeError):
    """A type or member buildidd needs is absent from the kernel's BTF."""


class ElfError(BuildiddError):
    """A file could not yield a build-id because of its contents.

    Attributes:
        reason: a short stable token recorded in the session's ``error`` field,
            a :class:`buildidd.resolve.reasons.MissReason` (a ``str`` enum;
            this shared module imports no stage, hence ``str`` here):
            ``NOT_ELF`` (no ELF magic), ``MALFORMED_ELF`` (headers or notes
            out of bounds or inconsistent), ``UNSUPPORTED_ELF`` (a class or
            byte order the reader does not handle, or a cap reached).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class FileRefusedError(BuildiddError):
    """A file a user controls was not opened for reading (resolve.procfs.open_identified).

    Attributes:
        reason: ``not_regular`` (a FIFO, device, directory or symlink),
            ``slow_fs`` (on FUSE), or why it is another file than the one
            mapped: ``other_inode``, ``other_generation``, ``modified``.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class SessionLogError(BuildiddError):
    """The session log cannot be written or read (I/O error, full disk, bad segment)."""


class StoreError(BuildiddError):
    """The build-id store cannot add or find an entry."""


class StoreRefusedError(StoreError):
    """The store would not take a file (buildidd.store): a limit, not a failure.

    Attributes:
        reason: ``too_large`` (over ``store_file_max_bytes``), ``quota`` (no
            room left after eviction), ``uid_share`` (its owner's share of the
            quota is used up), ``alt_limit`` (too many contents claim that build-id).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class ProtocolError(BuildiddError):
    """A control-socket request is malformed, too large or unknown."""


class AnalysisError(BuildiddError):
    """A session cannot be replayed, symbolized or exported, or a query (address, time) is malformed."""


class ArchiveError(BuildiddError):
    """A session archive cannot be written, or is refused on import (malformed or hostile).

    Attributes:
        reason: a short stable token naming the check that failed
            (``"absolute_path"``, ``"dotdot"``, ``"symlink_escape"``,
            ``"hard_link"``, ``"device"``, ``"fifo"``, ``"build_id_mismatch"``,
            ``"too_large"``, ``"too_many_members"``, ``"zstd_bomb"``, ...; the
            importer's docstring lists them all).
        message: the text without the reason.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{message} [{reason}]")
        self.reason = reason
        self.message = message


class ServeError(BuildiddError):
    """``buildidd serve`` cannot start (address, token, TLS, store), or ``pull`` cannot fetch from a serve."""


class ServeRefusedError(ServeError):
    """A serve refused ``pull`` its session logs (HTTP 401 or 403): permission denied, exit status 4."""

    exit_code = 4


class PushError(BuildiddError):
    """The bucket refused or did not answer a request of ``buildidd push`` (buildidd.fleet).

    Attributes:
        cause: a short stable token (buildidd.fleet.bucket.CAUSES): ``unreachable`` (no connection),
            ``timeout``, ``credentials`` (none found, or refused), ``denied`` (AccessDenied, or any 403 to a HEAD, whose answer has no body to say why),
            ``full`` (the server is out of space or over a quota), ``throttled`` (SlowDown, 503),
            ``server`` (another 5xx), ``client`` (another 4xx), ``source`` (a local file could not be read),
            ``config`` (no bucket configured, a malformed name).
    """

    def __init__(self, cause: str, message: str):
        super().__init__(f"{message} [{cause}]")
        self.cause = cause
