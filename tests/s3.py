"""The tests' S3 harness: credentials, a boto3 client, a fresh bucket, an obj tier config, and the
servers the tests run on loopback.

- :func:`start_moto`: moto's threaded server (fast, in-process, no signature checks).
- :class:`Nanio`: the ``nanio`` server in a subprocess, with SigV4 credentials, on disk.
- :class:`FaultProxy`: forwards to an upstream endpoint and injects faults by rule: an HTTP error
  status with an S3 XML body, a hang, a dropped connection; it can be stopped (connection refused)
  and restarted on the same port.

The servers, the proxy and ``free_port`` live in the installed package (``kvoffload.tools.s3_server``,
``kvoffload.tools.faultproxy``, ``kvoffload.tools.ports``) because installed commands start them too:
``kvoffload demo`` and ``stress --obj`` (moto), ``bench obj`` (nanio), ``stress --flaky-s3`` (the
proxy), the demo's vLLM servers (a port).
"""

from __future__ import annotations

import uuid

import boto3
from botocore.config import Config

from kvoffload.tools.faultproxy import FaultProxy, Rule  # noqa: F401
from kvoffload.tools.ports import free_port  # noqa: F401
from kvoffload.tools.s3_server import Nanio as _Nanio
from kvoffload.tools.s3_server import start_moto  # noqa: F401

ACCESS = "kvoffload-test"
SECRET = "kvoffload-secret-key-0123456789"


def client(endpoint: str, access: str = ACCESS, secret: str = SECRET):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=access,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def new_bucket(endpoint: str) -> str:
    name = f"kv-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name


def obj_tier(endpoint: str, bucket: str, **extra) -> dict:
    cfg = {
        "type": "obj",
        "bucket": bucket,
        "endpoint_override": endpoint,
        "region": "us-east-1",
        "access_key_id": ACCESS,
        "secret_access_key": SECRET,
        "addressing_style": "path",
        "io_workers": 1,
        "io_threads": 4,
        "job_timeout_s": 10.0,
    }
    cfg.update(extra)
    return cfg


class Nanio(_Nanio):
    """nanio with the test credentials."""

    def __init__(self, data_dir: str):
        super().__init__(data_dir, ACCESS, SECRET)
