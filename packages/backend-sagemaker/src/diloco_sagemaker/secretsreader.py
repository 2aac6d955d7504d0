"""Secrets Manager's GetSecretValue with the standard library only; uploaded beside the bootstrap.

The bootstrap resolves secret references before anything of the user's is importable, and an
image need not hold boto3 (the reference image, packages/replica/Dockerfile, does not). So when
boto3 is absent this module makes the one call itself: credentials found the way botocore finds
them in a container — environment variables, then the container credentials endpoint
(AWS_CONTAINER_CREDENTIALS_FULL_URI or _RELATIVE_URI, with AWS_CONTAINER_AUTHORIZATION_TOKEN[_FILE]),
then the instance metadata service (IMDSv2) — and the request signed with Signature Version 4.
The endpoint is AWS_ENDPOINT_URL_SECRETS_MANAGER, AWS_ENDPOINT_URL, or the region's.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

ECS_HOST = "http://169.254.170.2"
IMDS = "http://169.254.169.254"
TIMEOUT = 5.0
RETRIES = 4
SERVICE = "secretsmanager"


class SecretsError(Exception):
    """The secret could not be read; the message says why in one line."""


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> str:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:  # noqa: S310 - fixed AWS endpoints
        return resp.read().decode()


def credentials() -> dict[str, str]:
    """{"key", "secret", "token"} of the container's AWS identity."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"],
                "token": env.get("AWS_SESSION_TOKEN", "")}
    full, relative = env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"), env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
    if full or relative:
        headers = {}
        token = env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN")
        if env.get("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"):
            with open(env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"]) as f:
                token = f.read().strip()
        if token:
            headers["Authorization"] = token
        data = json.loads(_get(full or ECS_HOST + relative, headers))
        return {"key": data["AccessKeyId"], "secret": data["SecretAccessKey"], "token": data.get("Token", "")}
    try:
        token = _get(f"{IMDS}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, "PUT")
        auth = {"X-aws-ec2-metadata-token": token}
        role = _get(f"{IMDS}/latest/meta-data/iam/security-credentials/", auth).split()[0]
        data = json.loads(_get(f"{IMDS}/latest/meta-data/iam/security-credentials/{role}", auth))
    except (OSError, ValueError, IndexError) as exc:
        raise SecretsError(f"no AWS credentials in the container (environment, container endpoint or instance "
                           f"metadata): {exc}") from None
    return {"key": data["AccessKeyId"], "secret": data["SecretAccessKey"], "token": data.get("Token", "")}


def _sign(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def signed_headers(creds: dict[str, str], region: str, host: str, target: str, body: bytes,
                   now: datetime.datetime | None = None) -> dict[str, str]:
    """The headers of a SigV4-signed JSON 1.1 POST to `/` of `host`."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {"content-type": "application/x-amz-json-1.1", "host": host, "x-amz-date": amz_date,
               "x-amz-target": target}
    if creds.get("token"):
        headers["x-amz-security-token"] = creds["token"]
    names = sorted(headers)
    canonical = "\n".join(["POST", "/", "", *(f"{n}:{headers[n].strip()}" for n in names), "", ";".join(names),
                           hashlib.sha256(body).hexdigest()])
    scope = f"{day}/{region}/{SERVICE}/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    k = _sign(_sign(_sign(_sign(f"AWS4{creds['secret']}".encode(), day), region), SERVICE), "aws4_request")
    signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds['key']}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return headers


def endpoint(region: str) -> str:
    return (os.environ.get("AWS_ENDPOINT_URL_SECRETS_MANAGER") or os.environ.get("AWS_ENDPOINT_URL")
            or f"https://secretsmanager.{region}.amazonaws.com")


def get_secret_string(secret_id: str, region: str, creds: dict[str, str] | None = None) -> str:
    """SecretString of `secret_id` (a name or ARN), retrying throttles and server errors."""
    creds = creds or credentials()
    url = endpoint(region).rstrip("/") + "/"
    body = json.dumps({"SecretId": secret_id}).encode()
    for attempt in range(RETRIES + 1):
        headers = signed_headers(creds, region, urllib.parse.urlparse(url).netloc, "secretsmanager.GetSecretValue",
                                 body)
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT * 2) as resp:  # noqa: S310 - an AWS endpoint
                data = json.loads(resp.read())
            if "SecretString" not in data:
                raise SecretsError(f"secret {secret_id} holds binary data, not a string")
            return data["SecretString"]
        except urllib.error.HTTPError as exc:
            try:
                err = json.loads(exc.read() or b"{}")
            except ValueError:
                err = {}
            code = str(err.get("__type", exc.code)).rpartition("#")[2]
            if (exc.code >= 500 or "Throttl" in code) and attempt < RETRIES:
                time.sleep(0.5 * 2 ** attempt)
                continue
            raise SecretsError(f"{code}: {err.get('message') or err.get('Message') or exc.reason}") from None
    raise SecretsError("unreachable")  # pragma: no cover
