"""Configuration: one frozen dataclass holding every default and its unit.

Read from TOML (default /etc/buildidd/buildidd.toml, a flat table whose keys are
the field names below) and overridden by command-line options.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass

from buildidd.errors import ConfigError

DEFAULT_CONFIG_PATH = "/etc/buildidd/buildidd.toml"


@dataclass(frozen=True)
class Config:
    """Every tunable of the daemon.

    Attributes:
        session_root: directory under which each run gets its session directory.
        segment_max_bytes: a segment is closed once it holds this many bytes.
        segment_max_age_s: ... or once it is this many seconds old.
        compress: zstd-compress closed segments.
        ringbuf_bytes: size of the BPF ring buffer (power-of-two pages).
        poll_interval_s: the ring buffers are drained this often while events
            arrive (they are submitted without wake-ups, see bpf/buildidd.bpf.c).
        idle_poll_interval_s: ... and at most this often while none do.
        drop_check_interval_s: how often kernel drop counters are read.
        recording_nice: nice value (-20..19) the thread that drains the rings
            switches to while they fill faster than it drains them, so that
            CPU-bound work on every core cannot starve it into losing events
            (see Recorder._adjust_priority); not lower than the process's own.
        identity_cache_entries: identities whose build-id answer is kept (LRU);
            also the size of the kernel's known_ids map.
        pending_lines_max_bytes: records kept in memory while the log cannot
            be written (full disk); beyond it the oldest are dropped and counted.
        control_socket: path of the control socket ("" disables it).
        control_group: group whose members may use the control socket.
        store_root: the build-id store, laid out as perf's build-id cache
            ("" disables snapshots).
        store_quota_bytes: the store's size limit (0: none).
        snapshot_rate_bytes_per_s: copy bandwidth for snapshots (0: unlimited).
        session_max_age_s: sessions older than this are deleted (0: kept).
        session_max_total_bytes: oldest sessions go while all exceed this (0: no limit).
    """

    session_root: str = "/var/lib/buildidd/sessions"
    segment_max_bytes: int = 64 << 20
    segment_max_age_s: float = 3600.0
    compress: bool = True
    ringbuf_bytes: int = 32 << 20
    poll_interval_s: float = 0.005
    idle_poll_interval_s: float = 0.05
    drop_check_interval_s: float = 0.25
    recording_nice: int = -5
    identity_cache_entries: int = 65536
    pending_lines_max_bytes: int = 64 << 20
    control_socket: str = "/run/buildidd/control.sock"
    control_group: str = "buildidd"
    store_root: str = "/var/lib/buildidd/store"
    store_quota_bytes: int = 10 << 30
    snapshot_rate_bytes_per_s: int = 50 << 20
    session_max_age_s: float = 30 * 86400.0
    session_max_total_bytes: int = 5 << 30

    def replace(self, **changes) -> "Config":
        """A copy with changes applied (None values are ignored). Raises ConfigError."""
        changes = {k: v for k, v in changes.items() if v is not None}
        try:
            new = dataclasses.replace(self, **changes)
        except TypeError as e:
            raise ConfigError(str(e)) from e
        new.validate()
        return new

    def validate(self) -> None:
        """Raises ConfigError on a value out of range."""
        if self.segment_max_bytes < 4096:
            raise ConfigError("segment_max_bytes must be at least 4096")
        if self.segment_max_age_s <= 0:
            raise ConfigError("segment_max_age_s must be positive")
        if not 0 < self.poll_interval_s <= 1:
            raise ConfigError("poll_interval_s must be in (0, 1]")
        if self.store_root and os.path.abspath(self.store_root).startswith(
                os.path.abspath(self.session_root).rstrip("/") + "/"):
            raise ConfigError("store_root must not lie inside session_root (retention deletes its subdirectories)")
        if not -20 <= self.recording_nice <= 19:
            raise ConfigError("recording_nice must be in -20..19")
        if self.identity_cache_entries < 16:
            raise ConfigError("identity_cache_entries must be at least 16")


def load(path: str | None, *, required: bool = False) -> Config:
    """Config from a TOML file; the defaults when path is None or (not required) absent.

    Raises:
        ConfigError: unreadable or invalid file, unknown key, wrong type.
    """
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no such file") from None
        return Config()
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from e
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{path}: unknown key {key!r}")
        want = type(getattr(Config(), key))
        if want is float and isinstance(value, int):
            value = float(value)
            data[key] = value
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ConfigError(f"{path}: {key} must be {want.__name__}")
    return Config().replace(**data)
