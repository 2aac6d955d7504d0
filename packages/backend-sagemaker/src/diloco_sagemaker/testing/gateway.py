"""The launcher's other AWS calls (S3, Secrets Manager, CloudWatch Logs): authorized, then served by moto.

moto serves these APIs faithfully but does not ask whether the caller may make the call. The
control plane's endpoint stands in front of it for the launcher's shell
(`AWS_ENDPOINT_URL_S3`, `_SECRETS_MANAGER`, `_CLOUDWATCH_LOGS`): each request's action and
resource are read from the request (`iam.s3_actions`, `iam.json_service_actions`), checked
against the caller's IAM policies, and forwarded unchanged to moto, or refused the way that
service refuses (S3: 403 AccessDenied in XML; JSON services: AccessDeniedException).
Replicas talk to moto directly, as the execution role (not authorized here).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any
from urllib.parse import urlparse

from .iam import Authorizer, Denied, json_service_actions, s3_actions, signer

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer", "host",
        "expect"}


def required_actions(method: str, raw_path: str, headers: Any, body: bytes) -> tuple[str, list[tuple[str, str]]]:
    """(access key, [(action, resource)]) a forwarded request needs."""
    who = signer(headers.get("Authorization"))
    if who is None:
        raise Denied("AccessDenied", "Anonymous requests are not allowed by the test control plane")
    key, region, service = who
    parsed = urlparse(raw_path)
    target = headers.get("X-Amz-Target")
    if target:
        operation = target.rpartition(".")[2]
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            req = {}
        return key, json_service_actions(service, operation, req, region)
    if service == "s3":
        query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
        return key, s3_actions(method, parsed.path, query, headers, body)
    return key, [(f"{service}:*", "*")]


def authorize(authorizer: Authorizer, method: str, raw_path: str, headers: Any, body: bytes,
              record: list[str]) -> None:
    key, needed = required_actions(method, raw_path, headers, body)
    for action, resource in needed:
        authorizer.authorize(key, action, resource)
        record.append(action)


def denial(headers: Any, exc: Denied) -> tuple[int, dict[str, str], bytes]:
    """The refusal as the service words it: (status, headers, body)."""
    who = signer(headers.get("Authorization"))
    if who and who[2] == "s3" or (who is None and not headers.get("X-Amz-Target")):
        code = "InvalidAccessKeyId" if exc.code == "UnrecognizedClientException" else "AccessDenied"
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{exc.message}</Message></Error>").encode()
        return 403, {"Content-Type": "application/xml"}, body
    body = json.dumps({"__type": exc.code, "Message": exc.message, "message": exc.message}).encode()
    return 400, {"Content-Type": "application/x-amz-json-1.1", "x-amzn-ErrorType": exc.code}, body


def forward(upstream: str, method: str, raw_path: str, headers: Any, body: bytes) -> tuple[int, list, bytes]:
    """The request, unchanged, to moto; (status, headers, body) of its answer."""
    up = urlparse(upstream)
    sent = {k: v for k, v in headers.items() if k.lower() not in _HOP}
    sent["Host"] = up.netloc
    conn = http.client.HTTPConnection(up.hostname, up.port or 80, timeout=120)
    try:
        conn.request(method, raw_path, body=body, headers=sent)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP | {"content-length"}], data
    finally:
        conn.close()
