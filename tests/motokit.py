"""An S3-compatible endpoint for tests: moto's standalone server on 127.0.0.1, reached through s3fs as a user's run
reaches S3, optionally enforcing IAM permissions (``deny``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

MOTO = Path(sys.executable).parent / "moto_server"
ADMIN = {"key": "testing", "secret": "testing"}  # accepted while the server checks no permission


class Endpoint:
    """moto's S3 server on a free port of 127.0.0.1; ``log`` is its request log (one line a request)."""

    def __init__(self, root: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "moto.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Endpoint:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def s3_config(self, credentials: dict | None = None) -> dict:
        """fsspec's configuration of ``s3://`` for this endpoint (``fsspec.config.conf["s3"]``): one try per request
        at the botocore and s3fs levels, so that what a test counts are xprep's own tries."""
        return {"endpoint_url": self.url, **(credentials or ADMIN),
                "config_kwargs": {"retries": {"max_attempts": 1}}}

    def requests(self, since: int = 0) -> list[str]:
        """The requests logged, from the ``since``-th on (one line each)."""
        return [line for line in self.log.read_text().splitlines() if '" ' in line][since:]

    def deny(self, action: str, *resources: str) -> list[dict]:
        """Credentials of a new IAM user per resource (an ARN, wildcards allowed), each allowed everything on S3 but
        ``action`` on its resource; from now on every request is checked against its signer's policies (moto's
        ``/moto-api/reset-auth``), so the admin credentials stop working."""
        import boto3
        import requests

        iam = boto3.client("iam", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id=ADMIN["key"],
                           aws_secret_access_key=ADMIN["secret"])
        credentials = []
        for k, resource in enumerate(resources):
            iam.create_user(UserName=f"reader{k}")
            policy = {"Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
                {"Effect": "Deny", "Action": action, "Resource": resource}]}
            iam.put_user_policy(UserName=f"reader{k}", PolicyName="reader", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=f"reader{k}")["AccessKey"]
            credentials.append({"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]})
        requests.post(f"{self.url}/moto-api/reset-auth", data=b"0", timeout=30).raise_for_status()
        return credentials


def use_endpoint(monkeypatch, endpoint: Endpoint, credentials: dict | None = None) -> None:
    """Point ``s3://`` at ``endpoint`` for this test (new s3fs instances: none cached from another configuration)."""
    import s3fs

    monkeypatch.setitem(fsspec.config.conf, "s3", endpoint.s3_config(credentials))
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    s3fs.S3FileSystem.clear_instance_cache()


def count_memory_reads(monkeypatch, suffix: str) -> list[int]:
    """The byte counts of every read of a file ending in ``suffix`` on fsspec's in-memory file system (``memory://``,
    the other object store of the tests) from now on, in order."""
    from fsspec.implementations.memory import MemoryFileSystem

    fetched: list[int] = []
    cat_file = MemoryFileSystem.cat_file

    def counted(self, path, start=None, end=None, **kwargs):
        data = cat_file(self, path, start, end, **kwargs)
        if str(path).endswith(suffix):
            fetched.append(len(data))
        return data

    monkeypatch.setattr(MemoryFileSystem, "cat_file", counted)
    return fetched
