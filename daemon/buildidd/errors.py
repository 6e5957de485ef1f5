"""The exception hierarchy.

Every error buildidd raises on purpose derives from :class:`BuildiddError`, so a
caller can tell our failures (with context) from bugs.  Set-up failures (a probe
that does not load, a bad configuration) stop the daemon before READY; per-event
failures are counted by the stage that met them and never stop the pipeline.
"""


class BuildiddError(Exception):
    """Base class of every error buildidd raises on purpose.

    Attributes:
        exit_code: the ``buildidd`` command's exit status when this error ends
            it (README "Exit status"): 1 failure, 2 usage, 3 daemon not
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
        reason: a short stable token recorded in the session's ``error`` field:
            ``"not_elf"`` (no ELF magic), ``"malformed_elf"`` (headers or notes
            out of bounds or inconsistent), ``"unsupported_elf"`` (a class or
            byte order the reader does not handle).
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class SessionLogError(BuildiddError):
    """The session log cannot be written or read (I/O error, full disk, bad segment)."""


class StoreError(BuildiddError):
    """The build-id store cannot add or find an entry."""


class ProtocolError(BuildiddError):
    """A control-socket request is malformed, too large or unknown."""


class AnalysisError(BuildiddError):
    """A session cannot be replayed, symbolized or exported, or a query (address, time) is malformed."""
