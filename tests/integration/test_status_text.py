"""`buildidd status` as an operator reads it, from a real daemon: the text says what the JSON knows (copies
skipped by reason with the key that helps, sessions' bytes against their limit, a failed reload), the
store's per-file refusals are logged at a limited rate and counted, a closed pipe is silent, ages are
never negative, rotate names the segments, and the start-up line names the socket's group."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from buildidd.cli.ctl import _human_status

CLI = [sys.executable, "-m", "buildidd.cli"]


def _status(ctl, *extra):
    r = subprocess.run([*CLI, "status", "--socket", str(ctl), *extra], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _wait(ctl, pred, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        s = json.loads(_status(ctl, "--json"))
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.5)


def test_status_text_reload_failure_quota_lines_and_closed_pipe(bpf, tmp_path):
    conf = tmp_path / "buildidd.toml"
    conf.write_text('store_quota_bytes = "64K"\n')
    ctl, notify, err = tmp_path / "ctl" / "control.sock", tmp_path / "notify.sock", tmp_path / "stderr"
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(str(notify))
    ns.settimeout(60)
    with open(err, "w") as errf:
        p = subprocess.Popen([*CLI, "run", "--config", str(conf), "--session-root", str(tmp_path / "s"),
                              "--store-root", str(tmp_path / "store"), "--control-socket", str(ctl)],
                             env={**os.environ, "NOTIFY_SOCKET": str(notify)}, stderr=errf)
    try:
        while "READY=1" not in ns.recv(4096).decode():
            pass
        for prog in ("/bin/true", "/bin/ls", "/usr/bin/env", "/bin/date", "/usr/bin/id", "/bin/uname"):
            subprocess.run([prog], stdout=subprocess.DEVNULL, check=False)
        s = _wait(ctl, lambda s: (s["snapshots"]["skipped"].get("quota", 0) >= 5
                                  and not s["snapshots"]["queued"]))
        quota = s["snapshots"]["skipped"]["quota"]
        assert quota >= 5, s["snapshots"]
        assert s["last_step_s_ago"] >= 0
        text = _status(ctl)
        assert re.search(r"^skipped   \d+ copies: .*quota \d+: raise store_quota_bytes \(now 64K\)", text, re.M), text
        assert re.search(rf"^sessions  1 under {re.escape(str(tmp_path / 's'))}: \d+\.\d [KM]iB of 5\.0 GiB "
                         r"\(session_max_total_bytes\), each kept 30 d \(session_max_age_s\)$", text, re.M), text
        assert re.search(r"^log       \d+ records, \d+\.\d [KM]iB written, 0 segments closed \(segment_max_bytes 64M\); "
                         r"0 write errors$", text, re.M), text
        assert re.search(r"^store     last error: quota: ", text, re.M), text
        assert "last step" in text and "-0." not in text.splitlines()[1]
        assert re.search(r"^resolve   \d+ workers \(0 stuck on a slow file, \d+ queued\), deadline 0\.2 s "
                         r"\(resolve_deadline_s\): \d+ timed out, \d+ answers pending; hand-overs \d+ dropped$",
                         text, re.M), text

        # A loss as the kernel reports it reads with the key that helps (the count itself cannot be
        # provoked on demand: the text of this daemon's own status, with one).
        lossy = dict(s, lost={"ringbuf_full": 336306, "no_vma": 2})
        assert ("lost      336308: no_vma 2: the mapping was gone before the BPF program looked; recovered by a "
                "rescan; ringbuf_full 336306: raise ring_bytes (now 2M), or lower recording_nice (now -5)"
                in _human_status(lossy).splitlines())

        # A reload that fails keeps the old configuration and says so in status.
        conf.write_text('store_quota_bytes = "64K"\nsegment_max_byte = "1M"\n')
        p.send_signal(signal.SIGHUP)
        s = _wait(ctl, lambda s: s.get("last_reload") is not None, 30)
        assert s["last_reload"]["ok"] is False and "unknown key 'segment_max_byte'" in s["last_reload"]["error"]
        assert any("config reload: " in e["error"] for e in s["last_errors"])
        text = _status(ctl)
        assert re.search(r"^reload    FAILED \d+ s ago, the previous configuration runs: .*unknown key "
                         r"'segment_max_byte'", text, re.M), text

        # rotate names what it closed and where the next record goes.
        r = subprocess.run([*CLI, "rotate", "--socket", str(ctl), "--json"], capture_output=True, text=True,
                           timeout=30)
        ans = json.loads(r.stdout)
        assert ans["rotated"] and ans["closed"].endswith(".jsonl") and ans["segment"].endswith(".jsonl")
        assert ans["segment"] != ans["closed"]

        # A reader that is gone: nothing on stderr, exit 0.
        rd, wr = os.pipe()
        os.close(rd)
        try:
            r = subprocess.run([*CLI, "status", "--socket", str(ctl), "--json"], stdout=wr, stderr=subprocess.PIPE,
                               text=True, timeout=30)
        finally:
            os.close(wr)
        assert r.returncode == 0 and r.stderr == ""
    finally:
        p.terminate()
        assert p.wait(timeout=60) == 0
    log = err.read_text()
    listening = next(line for line in log.splitlines() if "control socket listening on" in line)
    assert "None" not in listening and re.search(r"\(mode 660, group (buildidd \(gid \d+\)|gid \d+, not 'buildidd')\)",
                                                 listening), listening
    # Per-file refusals: at most 3 lines a minute for one reason, then one line with the count.
    assert len(re.findall(r"skipped: quota: ", log)) <= 3 + 1, log      # + the store's last_error line, none
    m = re.search(r"(\d+) more lines like the above \(skipped: quota\)", log)
    assert m and int(m.group(1)) >= quota - 3, log
