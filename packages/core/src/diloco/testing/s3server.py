"""A real S3 API for tests: moto's server on 127.0.0.1 with a fresh bucket.

Stand-in, not a double: boto3, obstore and every replica process talk to it over HTTP exactly
as they would to S3. Needs `moto[server]` and `boto3` (test dependencies, imported here only).
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Any, Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_s3(bucket: str = "diloco-test", prefix: str = "runs") -> Iterator[dict[str, Any]]:
    """Yields {"uri": s3://bucket/prefix, "env": AWS_* for processes, "client": boto3 client, "endpoint"}."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # the OS picks a free port as it
    server.start()                                                               # binds: no race with tests beside
    port = server.get_host_and_port()[1]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=bucket)
    try:
        yield {"uri": f"s3://{bucket}/{prefix}", "client": client, "env": env, "bucket": bucket}
    finally:
        server.stop()
