"""BPF programs as BCC compiled them, kept on disk across boots and loaded with plain bpf(2).

bpffs pins (kernel.pinned) make a restart cheap but die with the boot; the
first start of every boot would compile again (BCC's clang, ~0.66 s for the
main program and ~0.45 s for the page-cache probe on this kind of machine).
Here the loader's child's capture (kernel.compiled: instructions with their
callbacks linked in, and map definitions) is written to
``DIR/<source>-<key>.json``; a later start with the same key loads it with
kernel.objload, as the child did: the maps created, the programs loaded with
BPF_PROG_LOAD, one thread per CPU (the kernel's verifier still runs), and
attached (kernel.attach).  No BCC, no child process.

The key is a SHA-256 over the source and headers, cflags and attach lists
(LoadSpec.digest), the kernel release, /sys/kernel/notes (the running
kernel's build-id, so a rebuilt kernel of the same release is not mistaken
for this one; an iterator's BTF id is only valid there) and BCC's
version file.

The directory holds code that root loads into the kernel: it is used only
when it is a directory of this user's that nobody else may write (checked on
the open descriptor), and every entry only when it is a regular file of this
user's, writable by nobody else, with one link.  An entry that is malformed,
fails its digest or does not load is removed, and the start compiles as if
there were none.  A cache that cannot be written (read-only, full) costs
only the next first start's compile.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import stat
import time

from buildidd.errors import ProbeError
from buildidd.fsio import replace_file
from buildidd.kernel.compiled import CompiledObject
from buildidd.kernel.loader import LoadedProgram, LoadSpec, load
from buildidd.kernel.objload import load_object
from buildidd.kernel.pinned import load_pinned

log = logging.getLogger(__name__)

__all__ = ["load_program", "load_compiled", "cache_key"]

#: Bumped when the entry format changes (part of the key).
CACHE_FORMAT = 3
#: Largest entry read (the main program's is ~130 KB).
MAX_ENTRY_BYTES = 16 << 20

def load_program(spec: LoadSpec, pin_root: str | None = None, cache_dir: str | None = None) -> LoadedProgram:
    """spec loaded the cheapest way this host allows: from bpffs pins of this boot (pin_root),
    else from the compile cache (cache_dir), else compiled by BCC in the loader's child.

    Raises:
        ProbeError: as kernel.loader.load.
    """
    def fresh(s: LoadSpec) -> LoadedProgram:
        loaded = load_compiled(s, cache_dir) if cache_dir else load(s)
        loaded.compiled = None         # written to the cache, or not wanted: not kept for the run
        return loaded
    return load_pinned(spec, pin_root, fresh) if pin_root else fresh(spec)


def cache_key(spec: LoadSpec) -> str:
    """Hex key of spec compiled for this kernel by this BCC (see the module docstring).

    Raises:
        OSError: a source file or /sys/kernel/notes cannot be read.
    """
    h = spec.digest()
    h.update(f"\0format {CACHE_FORMAT}\0{os.uname().release}\0".encode())
    with open("/sys/kernel/notes", "rb") as f:
        h.update(f.read())
    found = importlib.util.find_spec("bcc")      # located, not imported: BCC maps libLLVM when imported
    for where in (found.submodule_search_locations or []) if found else []:
        try:
            with open(os.path.join(where, "version.py"), "rb") as f:
                h.update(f.read())
        except OSError:
            pass
    return h.hexdigest()[:32]


def load_compiled(spec: LoadSpec, cache_dir: str) -> LoadedProgram:
    """spec from the entry of cache_dir with its key when there is a usable one, else compiled
    (kernel.loader.load) and written there for the next first start.

    Returns:
        The LoadedProgram; ``cached`` True when it came from the cache (compile_s 0, attach_s the
        time to create, load and attach).
    Raises:
        ProbeError: as kernel.loader.load.
    """
    name = spec.name
    try:
        key = cache_key(spec)
        dir_fd = _open_dir(cache_dir)
    except OSError as e:
        log.info("BPF compile cache %s not used (%s)", cache_dir, e)
        return load(spec)
    try:
        entry = f"{name}-{key}.json"
        obj = _read(dir_fd, entry, key)
        if obj is not None:
            t0 = time.monotonic()
            try:
                loaded = load_object(obj, spec)
                loaded.cached = True
                loaded.attach_s = loaded.load_s = time.monotonic() - t0
                return loaded
            except (OSError, ProbeError, KeyError) as e:
                log.warning("cached BPF program %s/%s not loaded (%s): compiling", cache_dir, entry, e)
                _unlink(dir_fd, entry)
        loaded = load(spec)
        try:
            same = cache_key(spec) == key      # not the sources of an upgrade made during the compile
        except OSError:
            same = False
        if loaded.compiled is not None and same:
            _write(dir_fd, entry, key, loaded.compiled, name)
        return loaded
    finally:
        os.close(dir_fd)


def _open_dir(path: str) -> int:
    """An fd of path (made 0700 when absent), refused unless a directory of this user's that no
    group or other user may write.

    Raises:
        OSError: refused, or it cannot be made or opened.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise OSError(f"{path} is not a directory of this user's that only it can write "
                      f"(uid {st.st_uid}, mode {stat.filemode(st.st_mode)})")
    return fd


def _read(dir_fd: int, entry: str, key: str) -> CompiledObject | None:
    """The entry's object, or None (absent; refused or malformed, then removed, said in the log)."""
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:              # ELOOP: a symbolic link, which only root could have put there
        log.warning("BPF compile cache entry %s not opened (%s): removed, compiling", entry, e)
        _unlink(dir_fd, entry)
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022
                or st.st_nlink != 1 or st.st_size > MAX_ENTRY_BYTES):
            raise ValueError(f"not a regular file of this user's, writable only by it, of at most "
                             f"{MAX_ENTRY_BYTES} bytes (uid {st.st_uid}, mode {stat.filemode(st.st_mode)}, "
                             f"{st.st_nlink} links, {st.st_size} bytes)")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = json.loads(f.read(MAX_ENTRY_BYTES + 1))
        if not isinstance(data, dict) or data.get("key") != key:
            raise ValueError("written for another key")
        return CompiledObject.from_json(data.get("object"))
    except (OSError, ValueError) as e:
        log.warning("BPF compile cache entry %s refused (%s): removed, compiling", entry, e)
        _unlink(dir_fd, entry)
        return None
    finally:
        os.close(fd)


def _write(dir_fd: int, entry: str, key: str, obj: CompiledObject, name: str) -> None:
    """Write entry atomically (temporary file, fsync, rename) and remove the entries of other
    keys of the same source; a failure is logged and leaves no partial entry."""
    data = json.dumps({"key": key, "object": obj.to_json()}, separators=(",", ":")).encode()
    try:
        replace_file(dir_fd, entry, data, 0o600)
    except OSError as e:
        log.warning("BPF compile cache entry %s not written (%s): the next first start compiles", entry, e)
        return
    for other in os.listdir(dir_fd):     # other keys of this source; temporary files a crash left
        if (other.startswith(f"{name}-") and other.endswith(".json") and other != entry
                or other.startswith(f".{name}-") and other.endswith(".tmp")):
            _unlink(dir_fd, other)


def _unlink(dir_fd: int, entry: str) -> None:
    try:
        os.unlink(entry, dir_fd=dir_fd)
    except OSError:
        pass
