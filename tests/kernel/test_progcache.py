"""kernel.progcache and kernel.compiled: what BCC compiled, kept on disk and loaded with bpf(2) on a
later first start; refused when anyone but root could have written it, or when it is damaged."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import stat
import struct

import pytest

from conftest import recorded_exec, session_records

RING_BYTES = 2 << 20


def _prog_tag(fd: int) -> bytes:
    """struct bpf_prog_info.tag (bytes 8-15): the kernel's SHA-1 of the instructions as loaded,
    map fds left out (kernel/bpf/core.c, bpf_prog_calc_tag)."""
    from buildidd.kernel.bpfsys import BPF_OBJ_GET_INFO_BY_FD, _InfoAttr, bpf
    info = ctypes.create_string_buffer(256)
    bpf(BPF_OBJ_GET_INFO_BY_FD, _InfoAttr(bpf_fd=fd, info_len=len(info), info=ctypes.addressof(info)))
    return info.raw[8:16]


@pytest.fixture(scope="module")
def compiled_cache(tmp_path_factory):
    """A cache dir filled by one cold start of both programs (compiled by BCC in the child), and
    the kernel's tags of what BCC loaded: {function: tag}."""
    from conftest import need
    need(os.geteuid() == 0, "needs root")
    from buildidd.kernel.pagecache import PageCacheProbe
    from buildidd.kernel.tracer import Tracer
    d = tmp_path_factory.mktemp("bpfcache") / "cache"
    t = Tracer(ring_bytes=RING_BYTES, cache_dir=str(d))
    try:
        assert not t.prog.cached and t.compile_s > 0
        assert t.prog.compiled is None           # written to the cache, not kept for the run
        tags = {fn: _prog_tag(fd) for fn, fd in t.prog.progs.items()}
    finally:
        t.close()
    PageCacheProbe(cache_dir=str(d)).close()
    return d, tags


def _entries(d) -> dict[str, os.stat_result]:
    return {n: os.stat(os.path.join(d, n)) for n in os.listdir(d)}


def test_a_cold_start_writes_one_root_only_entry_per_program(bpf, compiled_cache):
    d, _ = compiled_cache
    entries = _entries(d)
    assert sorted(n.split("-")[0] for n in entries) == ["buildidd_bpf", "pagecache_probe_bpf"]
    for st in entries.values():
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_the_cached_load_is_what_bcc_loaded(bpf, compiled_cache):
    """Same kernel tag for every program: the instructions reach the verifier unchanged."""
    from buildidd.kernel.tracer import Tracer
    d, tags = compiled_cache
    t = Tracer(ring_bytes=RING_BYTES, cache_dir=str(d))
    try:
        assert t.prog.cached and t.compile_s == 0 and t.prog.compiled is None
        assert {fn: _prog_tag(fd) for fn, fd in t.prog.progs.items()} == tags
        assert {k for k in t.prog.links} == {
            "raw_tracepoint:sched_process_exec", "raw_tracepoint:sched_process_fork",
            "raw_tracepoint:sched_process_exit", "raw_tracepoint:task_rename", "raw_tracepoint:sys_exit"}
    finally:
        t.close()


def test_a_first_start_of_a_boot_records_from_the_cache(recorder, compiled_cache):
    """No pins (a new boot), the cache warm: nothing compiled, the page-cache path checked and on,
    an exec recorded with the build-id the kernel read."""
    d, _ = compiled_cache
    rec = recorder(bpf_pin_root="", bpf_cache_dir=str(d))
    session = session_records(rec.session_dir)[0]
    assert session["bpf_cached"] is True and session["bpf_reused"] is False and session["bpf_compile_s"] == 0
    assert session["kernel_build_id_path"] == {"enabled": True, "reason": None}
    seen = recorded_exec(rec, ["/bin/true"])
    assert seen and seen[0]["build_id"] and seen[0]["build_id_source"] == "kernel", seen


def _copy(compiled_cache, tmp_path):
    d = tmp_path / "cache"
    shutil.copytree(compiled_cache[0], d)
    return d


def _probe_entry(d):
    (name,) = [n for n in os.listdir(d) if n.startswith("pagecache_probe_bpf-")]
    return d / name


def test_a_cache_dir_another_user_owns_or_may_write_is_not_used(bpf, compiled_cache, tmp_path, attacker):
    from buildidd.kernel.progcache import _open_dir
    d = _copy(compiled_cache, tmp_path)
    os.chmod(d, 0o770)
    with pytest.raises(OSError, match="only it can write"):
        _open_dir(str(d))
    os.chmod(d, 0o700)
    os.chown(d, attacker[0], attacker[1])
    with pytest.raises(OSError, match="only it can write"):
        _open_dir(str(d))
    os.close(_open_dir(str(tmp_path / "new" / "cache")))           # absent: made, root's, 0700
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "cache").st_mode) == 0o700


@pytest.mark.parametrize("damage", ["attacker_owned", "group_writable", "hard_link", "truncated",
                                    "digest", "other_key", "symlink"])
def test_an_entry_that_cannot_be_trusted_is_refused_and_removed(bpf, compiled_cache, tmp_path, attacker, damage):
    from buildidd.kernel.progcache import _read
    d = _copy(compiled_cache, tmp_path)
    entry = _probe_entry(d)
    key = entry.name.removesuffix(".json").split("-", 1)[1]
    data = entry.read_bytes()
    if damage == "attacker_owned":
        os.chown(entry, attacker[0], attacker[1])
    elif damage == "group_writable":
        os.chmod(entry, 0o620)
    elif damage == "hard_link":
        os.link(entry, tmp_path / "other-name")
    elif damage == "truncated":
        entry.write_bytes(data[:len(data) // 2])
    elif damage == "digest":
        doc = json.loads(data)
        doc["object"]["body"]["maps"][0][4] += 1                   # one map's max_entries
        entry.write_text(json.dumps(doc))
    elif damage == "other_key":
        doc = json.loads(data)
        doc["key"] = "0" * 32
        entry.write_text(json.dumps(doc))
    elif damage == "symlink":
        target = tmp_path / "elsewhere.json"
        entry.rename(target)
        entry.symlink_to(target)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert _read(fd, entry.name, key) is None
    finally:
        os.close(fd)
    assert not os.path.lexists(entry)
    # The same entry undamaged is read.
    pristine = _probe_entry(compiled_cache[0])
    fd = os.open(compiled_cache[0], os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert _read(fd, pristine.name, key) is not None
    finally:
        os.close(fd)


def test_an_entry_the_verifier_refuses_is_replaced_by_a_compile(bpf, compiled_cache, tmp_path, caplog):
    """Well-formed, right digest, but a program the kernel will not load: compiled afresh, rewritten."""
    from buildidd.kernel.compiled import CompiledObject, CompiledProgram
    from buildidd.kernel.pagecache import PageCacheProbe
    d = _copy(compiled_cache, tmp_path)
    entry = _probe_entry(d)
    doc = json.loads(entry.read_bytes())
    obj = CompiledObject.from_json(doc["object"])
    exit_insn = struct.pack("<BBhi", 0x95, 0, 0, 0)                # BPF_EXIT without setting r0
    bad = tuple(CompiledProgram(p.function, p.prog_type, exit_insn, ()) for p in obj.programs)
    doc["object"] = CompiledObject(obj.maps, bad).to_json()
    entry.write_text(json.dumps(doc))
    probe = PageCacheProbe(cache_dir=str(d))
    try:
        assert not probe.prog.cached and probe.prog.compile_s > 0
    finally:
        probe.close()
    assert "not loaded" in caplog.text and "R0 !read_ok" in caplog.text
    rewritten = CompiledObject.from_json(json.loads(entry.read_bytes())["object"])
    assert rewritten == obj


def test_capture_keeps_map_references_by_name_and_refuses_other_pseudo_sources():
    from buildidd.errors import ProbeError
    from buildidd.kernel.compiled import capture_program
    ld_map = struct.pack("<BBhi", 0x18, 1 << 4 | 1, 0, 7) + struct.pack("<BBhi", 0, 0, 0, 0)
    ret = struct.pack("<BBhi", 0xb7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)
    p = capture_program("f", "raw_tracepoint", ld_map + ret, {7: "events0"})
    assert p.map_refs == ((0, "events0"),)
    assert struct.unpack_from("<i", p.insns, 4)[0] == 0                       # the child's fd is gone
    assert struct.unpack_from("<i", p.relocated({"events0": 42}), 4)[0] == 42
    ld_value = struct.pack("<BBhi", 0x18, 2 << 4 | 1, 0, 7) + struct.pack("<BBhi", 0, 0, 0, 0)
    with pytest.raises(ProbeError, match="pseudo source 2"):
        capture_program("g", "raw_tracepoint", ld_value + ret, {7: "events0"})


def test_a_compiled_object_from_disk_is_checked_field_by_field():
    from buildidd.kernel.compiled import CompiledMap, CompiledObject, CompiledProgram
    ld_map = struct.pack("<BBhi", 0x18, 1 << 4 | 1, 0, 0) + struct.pack("<BBhi", 0, 0, 0, 0)
    ret = struct.pack("<BBhi", 0x95, 0, 0, 0)
    good = CompiledObject((CompiledMap("m", 2, 4, 8, 1, 0, "m"),),
                          (CompiledProgram("f", "raw_tracepoint", ld_map + ret, ((0, "m"),)),))
    assert CompiledObject.from_json(json.loads(json.dumps(good.to_json()))) == good
    for bad in (CompiledProgram("f", "raw_tracepoint", ld_map + ret, ((2, "m"),)),   # not a map load
                CompiledProgram("f", "raw_tracepoint", ld_map + ret, ((0, "x"),)),   # unknown map
                CompiledProgram("f", "kprobe", ld_map + ret, ((0, "m"),)),           # unknown type
                CompiledProgram("f", "raw_tracepoint", ret[:5], ())):                # not whole insns
        doc = CompiledObject(good.maps, (bad,)).to_json()
        with pytest.raises(ValueError):
            CompiledObject.from_json(doc)
    doc = good.to_json()
    doc["body"]["maps"][0][1] = -1
    from buildidd.kernel.compiled import _digest
    doc["sha256"] = _digest(doc["body"])
    with pytest.raises(ValueError, match="unsigned 32-bit"):
        CompiledObject.from_json(doc)


def test_capture_refuses_kfunc_calls_and_objects_it_could_not_make_again():
    from buildidd.errors import ProbeError
    from buildidd.kernel.compiled import CompiledMap, CompiledObject, CompiledProgram, _digest, capture_program
    kfunc = struct.pack("<BBhi", 0x85, 2 << 4, 0, 1234) + struct.pack("<BBhi", 0x95, 0, 0, 0)
    with pytest.raises(ProbeError, match="kernel function"):
        capture_program("f", "raw_tracepoint", kfunc, {})
    ret = struct.pack("<BBhi", 0x95, 0, 0, 0)
    prog = CompiledProgram("f", "raw_tracepoint", ret, ())
    for maps, progs, match in (
            ((CompiledMap("m", 2, 4, 8, 1, 0, "m"), CompiledMap("m", 2, 4, 8, 1, 0, "m")), (prog,), "twice"),
            ((CompiledMap("m", 2, 4, 8, 1, 0, "m"),), (prog, prog), "twice"),
            ((CompiledMap("m", 12, 4, 4, 1, 0, "m"),), (prog,), "cannot be made")):   # array of maps
        doc = CompiledObject(maps, progs).to_json()
        doc["sha256"] = _digest(doc["body"])
        with pytest.raises(ValueError, match=match):
            CompiledObject.from_json(doc)


def test_the_key_follows_the_cflags(bpf):
    from buildidd.kernel.loader import LoadSpec
    from buildidd.kernel.progcache import cache_key
    from buildidd.kernel.events import BPF_DIR
    src = os.path.join(BPF_DIR, "pagecache_probe.bpf.c")
    a, b = LoadSpec(src, ("-DX=1",)), LoadSpec(src, ("-DX=2",))
    assert cache_key(a) == cache_key(LoadSpec(src, ("-DX=1",))) != cache_key(b)


def test_pins_and_cache_together_a_boot_loads_from_the_cache_then_pins_it(bpf, compiled_cache):
    """No pins yet, the cache warm (the first start of a boot): loaded from the cache and pinned;
    the next start (a restart) takes the pins."""
    from buildidd.kernel.pinned import _ensure_bpffs
    from buildidd.kernel.tracer import Tracer
    d, tags = compiled_cache
    root = f"/sys/fs/bpf/buildidd-test-cache-{os.getpid()}"
    _ensure_bpffs(root)
    try:
        t = Tracer(ring_bytes=RING_BYTES, pin_root=root, cache_dir=str(d))
        try:
            assert t.prog.cached and not t.prog.reused and t.compile_s == 0
        finally:
            t.close()
        assert [n for n in os.listdir(root) if n.startswith("buildidd_bpf-")]
        t = Tracer(ring_bytes=RING_BYTES, pin_root=root, cache_dir=str(d))
        try:
            assert t.prog.reused and not t.prog.cached
            assert {fn: _prog_tag(fd) for fn, fd in t.prog.progs.items()} == tags
        finally:
            t.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _insn(code, dst=0, src=0, off=0, imm=0) -> bytes:
    """One struct bpf_insn; imm taken as 32 bits (an LD_IMM64's upper half is unsigned)."""
    return struct.pack("<BBhI", code, src << 4 | dst, off, imm & 0xFFFFFFFF)


def test_capture_links_a_bpf_loop_callback_once_with_its_map_references():
    """BPF_CALLBACK(k) (bpf/callbacks.h) becomes a BPF_PSEUDO_FUNC load of callback k, appended
    once after the program; the callback's own map references follow it."""
    from buildidd.errors import ProbeError
    from buildidd.kernel.compiled import CALLBACK_MAGIC, PSEUDO_FUNC, capture_program
    cb_ref = _insn(0x18, 2, 0, 0, 0) + _insn(0, imm=CALLBACK_MAGIC)            # r2 = BPF_CALLBACK(0)
    main = (cb_ref + _insn(0x85, imm=181) + cb_ref + _insn(0x85, imm=181)       # two bpf_loop calls
            + _insn(0xb7) + _insn(0x95))
    cb = _insn(0x18, 1, 1, 0, 9) + _insn(0) + _insn(0xb7) + _insn(0x95)         # r1 = map fd 9; r0 = 0
    p = capture_program("f", "raw_tracepoint", main, {9: "scratch"}, callbacks={0: ("step", cb)})
    base = len(main) // 8
    assert p.subprogs == ((base, "step"),) and len(p.insns) == len(main) + len(cb)
    for at in (0, 3):
        code, regs, _, imm = struct.unpack_from("<BBhi", p.insns, at * 8)
        assert (code, regs >> 4, regs & 0xF, imm) == (0x18, PSEUDO_FUNC, 2, base - (at + 1))
        assert struct.unpack_from("<i", p.insns, (at + 1) * 8 + 4)[0] == 0
    assert p.map_refs == ((base, "scratch"),)
    with pytest.raises(ProbeError, match="names no callback"):
        capture_program("f", "raw_tracepoint", main, {9: "scratch"}, callbacks={1: ("step", cb)})
    with pytest.raises(ProbeError, match="where none can be linked"):
        capture_program("f", "raw_tracepoint", main, {9: "scratch"}, callbacks={0: ("step", main)})


def test_a_compiled_object_with_callbacks_round_trips_and_a_stray_function_load_is_refused():
    from buildidd.kernel.compiled import (CALLBACK_MAGIC, CompiledMap, CompiledObject, CompiledProgram,
                                          _digest, capture_program)
    main = _insn(0x18, 2, 0, 0, 0) + _insn(0, imm=CALLBACK_MAGIC) + _insn(0xb7) + _insn(0x95)
    cb = _insn(0xb7) + _insn(0x95)
    p = capture_program("f", "raw_tracepoint", main, {}, callbacks={0: ("step", cb)})
    obj = CompiledObject((CompiledMap("m", 2, 4, 8, 1, 0, "m"),), (p,))
    assert CompiledObject.from_json(json.loads(json.dumps(obj.to_json()))) == obj
    for subprogs in (((3, "step"),),            # the load names instruction 4, not 3
                     ((4, "not a name"),),      # BTF wants an identifier
                     ()):                       # no subprogram at all
        doc = CompiledObject(obj.maps, (CompiledProgram("f", "raw_tracepoint", p.insns, (), 0, 0, subprogs),)).to_json()
        doc["sha256"] = _digest(doc["body"])
        with pytest.raises(ValueError):
            CompiledObject.from_json(doc)


def test_capture_makes_kfunc_calls_and_the_load_writes_the_kernels_btf_id():
    """A call of helper KFUNC_MAGIC + k (bpf/kfuncs.h) becomes a BPF_PSEUDO_KFUNC_CALL of kfunc k
    with imm 0, in the program and in a callback; relocated() writes the BTF id in."""
    from buildidd.errors import ProbeError
    from buildidd.kernel.compiled import KFUNC_MAGIC, PSEUDO_KFUNC_CALL, capture_program
    call = _insn(0x85, imm=KFUNC_MAGIC)
    cb_ref = _insn(0x18, 2, 0, 0, 0) + _insn(0, imm=0xB1DDCA11)
    main = call + cb_ref + _insn(0x85, imm=181) + _insn(0xb7) + _insn(0x95)
    cb = _insn(0xb7) + call + _insn(0x95)
    p = capture_program("f", "raw_tracepoint", main, {}, callbacks={0: ("step", cb)})
    base = len(main) // 8
    assert p.kfunc_refs == ((0, "bpf_rdonly_cast"), (base + 1, "bpf_rdonly_cast"))
    for at, _ in p.kfunc_refs:
        code, regs, off, imm = struct.unpack_from("<BBhi", p.insns, at * 8)
        assert (code, regs >> 4, off, imm) == (0x85, PSEUDO_KFUNC_CALL, 0, 0)
    code = p.relocated({}, {"bpf_rdonly_cast": 65486})
    assert [struct.unpack_from("<i", code, at * 8 + 4)[0] for at, _ in p.kfunc_refs] == [65486, 65486]
    with pytest.raises(KeyError):
        p.relocated({})
    with pytest.raises(ProbeError, match="names none"):                          # kfunc 1: KFUNCS has one
        capture_program("f", "raw_tracepoint", _insn(0x85, imm=KFUNC_MAGIC + 1) + _insn(0x95), {})


def test_a_cached_kfunc_call_must_be_one_the_capture_made():
    """From disk: a kfunc call at no kfunc_refs index, with an id already in it, or of a function
    outside KFUNCS, and a kfunc_refs index that is not a call, are refused."""
    from buildidd.kernel.compiled import (KFUNC_MAGIC, CompiledMap, CompiledObject, CompiledProgram, _digest,
                                          capture_program)
    main = _insn(0x85, imm=KFUNC_MAGIC) + _insn(0xb7) + _insn(0x95)
    p = capture_program("f", "raw_tracepoint", main, {})
    maps = (CompiledMap("m", 2, 4, 8, 1, 0, "m"),)
    obj = CompiledObject(maps, (p,))
    assert CompiledObject.from_json(json.loads(json.dumps(obj.to_json()))) == obj
    with_id = _insn(0x85, 0, 2, 0, 1234) + p.insns[8:]
    for insns, refs in ((p.insns, ()),                                       # a call nothing lists
                        (with_id, ((0, "bpf_rdonly_cast"),)),                # an id from the file
                        (p.insns, ((0, "bpf_task_release"),)),               # not in KFUNCS
                        (p.insns, ((0, "bpf_rdonly_cast"), (1, "bpf_rdonly_cast")))):   # 1 is no call
        doc = CompiledObject(maps, (CompiledProgram("f", "raw_tracepoint", insns, (), kfunc_refs=refs),)).to_json()
        doc["sha256"] = _digest(doc["body"])
        with pytest.raises(ValueError):
            CompiledObject.from_json(doc)


def test_every_program_verifies_in_well_under_the_verifier_limit(bpf, compiled_cache):
    """The verifier's own count (BPF_LOG_STATS) of each program of both sources stays under half of
    BPF_COMPLEXITY_LIMIT_INSNS (1,000,000): the path walk is a bpf_loop (bpf/callbacks.h), and no
    kernel release that follows a few more states can push a program over the limit."""
    from buildidd.kernel import objload
    from buildidd.kernel.bpfsys import bpf as bpf_call
    from buildidd.kernel.btf import Btf
    from buildidd.kernel.compiled import PROG_TYPES, CompiledObject
    from buildidd.kernel.layout import kld_support
    d, _ = compiled_cache
    kfunc_ids = dict(kld_support(Btf.load())[1])
    seen = {}
    for name in os.listdir(d):
        obj = CompiledObject.from_json(json.loads((d / name).read_bytes())["object"])
        fds = {m.name: bpf_call(objload.BPF_MAP_CREATE, objload._MapCreateAttr(
            map_type=m.type, key_size=m.key_size, value_size=m.value_size, max_entries=m.max_entries,
            map_flags=m.flags, map_name=m.kernel_name.encode()[:15])) for m in obj.maps}
        try:
            for p in obj.programs:
                code = p.relocated(fds, kfunc_ids)
                insns = ctypes.create_string_buffer(code, len(code))
                lic = ctypes.create_string_buffer(b"GPL")
                log = ctypes.create_string_buffer(1 << 16)
                attr = objload._ProgLoadAttr(
                    prog_type=PROG_TYPES[p.prog_type], insn_cnt=len(code) // 8, insns=ctypes.addressof(insns),
                    license=ctypes.addressof(lic), expected_attach_type=p.expected_attach_type,
                    attach_btf_id=p.attach_btf_id, log_level=4, log_size=len(log), log_buf=ctypes.addressof(log))
                btf_fd = -1
                if p.subprogs:
                    blob, info = objload.func_info_btf(p)
                    btf_fd = objload._load_btf(blob)
                    info_buf = ctypes.create_string_buffer(info, len(info))
                    attr.prog_btf_fd, attr.func_info_rec_size = btf_fd, 8
                    attr.func_info, attr.func_info_cnt = ctypes.addressof(info_buf), len(info) // 8
                try:
                    os.close(bpf_call(objload.BPF_PROG_LOAD, attr))
                finally:
                    if btf_fd >= 0:
                        os.close(btf_fd)
                m = re.search(rb"processed (\d+) insns", log.value)
                seen[p.function] = int(m.group(1))
        finally:
            for fd in fds.values():
                os.close(fd)
    assert {"on_sys_exit", "exec_vmas", "bpf_iter__task_vma", "on_sched_process_exec"} <= seen.keys()
    assert max(seen.values()) < 500_000, seen


def test_an_object_from_disk_may_name_no_fd_function_or_kernel_function_the_capture_did_not_make():
    """The cache is loaded by root: a map load not among the map references (its imm would be one
    of the daemon's fds), a stray pseudo source, a kfunc call, a subprogram nothing names, or a
    name BTF would not take is refused before anything reaches the kernel."""
    from buildidd.kernel.compiled import CompiledMap, CompiledObject, CompiledProgram, _digest
    ld_map = _insn(0x18, 1, 1, 0, 0) + _insn(0)
    ret = _insn(0xb7) + _insn(0x95)
    maps = (CompiledMap("m", 2, 4, 8, 1, 0, "m"),)
    good = CompiledProgram("f", "raw_tracepoint", ld_map + ret, ((0, "m"),))
    assert CompiledObject.from_json(CompiledObject(maps, (good,)).to_json()).programs == (good,)
    for bad, why in (
            (CompiledProgram("f", "raw_tracepoint", ld_map + ld_map + ret, ((0, "m"),)), "unlisted map load"),
            (CompiledProgram("f", "raw_tracepoint", _insn(0x18, 1, 1, 0, 5) + _insn(0) + ret, ((0, "m"),)),
             "a map load with an fd in it"),
            (CompiledProgram("f", "raw_tracepoint", _insn(0x18, 1, 0, 0, 0) + _insn(0) + ret, ((0, "m"),)),
             "a reference on a plain constant"),
            (CompiledProgram("f", "raw_tracepoint", _insn(0x18, 1, 6, 0, 0) + _insn(0) + ret, ()), "map value"),
            (CompiledProgram("f", "raw_tracepoint", _insn(0x85, 0, 2, 0, 7) + ret, ()), "kfunc call"),
            (CompiledProgram("f", "raw_tracepoint", ret + ret, (), 0, 0, ((2, "step"),)), "unnamed subprogram"),
            (CompiledProgram("f\u00e9", "raw_tracepoint", ret, ()), "not ASCII"),
            (CompiledProgram("f", "raw_tracepoint", ld_map, ((0, "m"),)), "no exit, but whole")):
        doc = CompiledObject(maps, (bad,)).to_json()
        doc["sha256"] = _digest(doc["body"])
        if why == "no exit, but whole":     # structurally fine: the verifier, not this check, refuses it
            CompiledObject.from_json(doc)
            continue
        with pytest.raises(ValueError):
            CompiledObject.from_json(doc)
