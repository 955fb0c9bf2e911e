"""A real S3-compatible server on 127.0.0.1 for tests: moto in server mode (the dev extra).

`s3_server()` starts `moto_server -H 127.0.0.1 -p PORT` in its own process group, waits
until it answers, and yields the environment a client needs (endpoint, dummy
credentials, region) -- pyarrow, boto3 and Ray's storage layer all read these
variables, as they read an instance profile's on a cloud node. On exit it stops exactly
that process group (by pid, never by name). Bounded: 30 s to come up, 10 s to go down.
`s3_bucket()` is the fixtures' whole story: a server, one bucket, and those variables in
this process's environment for as long as it lasts (restored, or removed, on exit).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

MOTO = Path(sys.executable).parent / "moto_server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(log_dir: Path) -> Iterator[dict[str, str]]:
    port = _free_port()
    log = open(log_dir / "moto.log", "wb")
    proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not come up on {endpoint}: "
                                       f"{(log_dir / 'moto.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def make_bucket(env: dict[str, str], name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                 aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"]
                 ).create_bucket(Bucket=name)


@contextlib.contextmanager
def s3_bucket(log_dir: Path, bucket: str) -> Iterator[dict[str, str]]:
    """`s3_server` with `bucket` created and its environment in os.environ until exit (then restored)."""
    import pytest

    with s3_server(log_dir) as env, pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        make_bucket(env, bucket)
        yield env
