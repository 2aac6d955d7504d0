"""IAM for the test control plane: who signed a request, and whether their policies allow it.

AWS authorizes every call against the caller's identity-based policies; a missing action is
`AccessDeniedException: User: arn:… is not authorized to perform: sagemaker:AddTags on
resource: arn:… because no identity-based policy allows the sagemaker:AddTags action`. The
control plane does the same for the calls the launcher makes: the caller is the IAM user that
owns the request's access key (read from the SigV4 `Authorization` header), its policies are
the user's inline and attached policies in moto's IAM, and a statement matches on `Action` and
`Resource` with IAM's wildcards; an explicit Deny wins. Not modelled: conditions, groups,
permission boundaries, resource policies (none of the launcher's calls depend on them).

`create_launcher_identity` makes such a user with a given policy and returns its keys.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
from typing import Any

from .jobfiles import ACCOUNT

CACHE_SECONDS = 0.5
_CREDENTIAL = re.compile(r"Credential=([^/]+)/\d{8}/([^/]+)/([^/]+)/aws4_request")


class Denied(Exception):
    """The identity may not do `action` on `resource` (or is unknown)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def signer(authorization: str | None) -> tuple[str, str, str] | None:
    """(access key, region, service) from a SigV4 Authorization header."""
    m = _CREDENTIAL.search(authorization or "")
    return (m[1], m[2], m[3]) if m else None


def _iam(aws_endpoint: str) -> Any:
    import boto3

    return boto3.client("iam", endpoint_url=aws_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def create_launcher_identity(aws_endpoint: str, policy: dict[str, Any], name: str = "diloco-launcher") -> dict[str, str]:
    """An IAM user holding exactly `policy` (inline), with fresh access keys: the identity that
    runs diloco. Returns AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for its shell."""
    iam = _iam(aws_endpoint)
    try:
        iam.create_user(UserName=name)
    except iam.exceptions.EntityAlreadyExistsException:  # moto keeps IAM across servers in one process:
        for old in iam.list_user_policies(UserName=name)["PolicyNames"]:  # start from nothing
            iam.delete_user_policy(UserName=name, PolicyName=old)
        for old in iam.list_access_keys(UserName=name)["AccessKeyMetadata"]:
            iam.delete_access_key(UserName=name, AccessKeyId=old["AccessKeyId"])
    iam.put_user_policy(UserName=name, PolicyName="diloco", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}


def add_deny(aws_endpoint: str, user: str, action: str) -> None:
    """An explicit Deny of `action` for `user` (a test's way to take one permission away)."""
    iam = _iam(aws_endpoint)
    doc = {"Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Action": action, "Resource": "*"}]}
    iam.put_user_policy(UserName=user, PolicyName=f"deny-{action.replace(':', '-')}", PolicyDocument=json.dumps(doc))


def _document(doc: Any) -> dict[str, Any]:
    if isinstance(doc, str):
        doc = json.loads(urllib.parse.unquote(doc) if doc.lstrip().startswith("%") else doc)
    return doc


def _listed(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _wildcard(pattern: str, value: str, *, case: bool) -> bool:
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, value, 0 if case else re.IGNORECASE) is not None


class Authorizer:
    """Policy decisions for the identities in moto's IAM, cached for a moment per access key."""

    def __init__(self, aws_endpoint: str):
        self.aws_endpoint = aws_endpoint
        self._cache: dict[str, tuple[float, str, list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def identity(self, access_key: str) -> tuple[str, list[dict[str, Any]]]:
        """(user ARN, policy statements) of the key's owner; Denied for a key IAM does not know."""
        with self._lock:
            hit = self._cache.get(access_key)
            if hit and time.monotonic() - hit[0] < CACHE_SECONDS:
                return hit[1], hit[2]
        iam = _iam(self.aws_endpoint)
        try:
            user = iam.get_access_key_last_used(AccessKeyId=access_key)["UserName"]
        except Exception:  # noqa: BLE001 - moto answers an unknown key with one error or another
            raise Denied("UnrecognizedClientException", "The security token included in the request is invalid.") \
                from None
        statements: list[dict[str, Any]] = []
        for name in iam.list_user_policies(UserName=user)["PolicyNames"]:
            doc = iam.get_user_policy(UserName=user, PolicyName=name)["PolicyDocument"]
            statements += _listed_statements(_document(doc))
        for attached in iam.list_attached_user_policies(UserName=user)["AttachedPolicies"]:
            policy = iam.get_policy(PolicyArn=attached["PolicyArn"])["Policy"]
            version = iam.get_policy_version(PolicyArn=attached["PolicyArn"], VersionId=policy["DefaultVersionId"])
            statements += _listed_statements(_document(version["PolicyVersion"]["Document"]))
        arn = f"arn:aws:iam::{ACCOUNT}:user/{user}"
        with self._lock:
            self._cache[access_key] = (time.monotonic(), arn, statements)
        return arn, statements

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()

    def authorize(self, access_key: str, action: str, resource: str) -> str:
        """The caller's ARN if its policies allow `action` on `resource`; Denied otherwise."""
        arn, statements = self.identity(access_key)
        allowed = False
        for st in statements:
            if not any(_wildcard(a, action, case=False) for a in _listed(st.get("Action"))):
                continue
            if not any(_wildcard(r, resource, case=True) for r in _listed(st.get("Resource"))):
                continue
            if st.get("Effect") == "Deny":
                raise Denied("AccessDeniedException", f"User: {arn} is not authorized to perform: {action} on "
                             f"resource: {resource} with an explicit deny in an identity-based policy")
            allowed = True
        if not allowed:
            raise Denied("AccessDeniedException", f"User: {arn} is not authorized to perform: {action} on resource: "
                         f"{resource} because no identity-based policy allows the {action} action")
        return arn


def _listed_statements(doc: dict[str, Any]) -> list[dict[str, Any]]:
    st = doc.get("Statement", [])
    return [st] if isinstance(st, dict) else list(st)


# -- which actions a request needs ---------------------------------------------------------------

def sagemaker_actions(operation: str, req: dict[str, Any], region: str) -> list[tuple[str, str]]:
    """(action, resource) pairs a SageMaker call needs (the service authorization reference)."""
    job = f"arn:aws:sagemaker:{region}:{ACCOUNT}:training-job/{str(req.get('TrainingJobName', '*')).lower()}"
    if operation == "CreateTrainingJob":
        out = [("sagemaker:CreateTrainingJob", job)]
        if req.get("Tags"):
            out.append(("sagemaker:AddTags", job))  # tags on create are authorized as AddTags too
        if req.get("RoleArn"):
            out.append(("iam:PassRole", req["RoleArn"]))  # the execution role is handed to SageMaker
        return out
    if operation in ("DescribeTrainingJob", "StopTrainingJob"):
        return [(f"sagemaker:{operation}", job)]
    return [(f"sagemaker:{operation}", "*")]


def json_service_actions(service: str, operation: str, req: dict[str, Any], region: str) -> list[tuple[str, str]]:
    """(action, resource) pairs for a Secrets Manager or CloudWatch Logs call."""
    if service == "secretsmanager":
        ref = str(req.get("SecretId") or req.get("Name") or "*")
        arn = ref if ref.startswith("arn:") else f"arn:aws:secretsmanager:{region}:{ACCOUNT}:secret:{ref}-??????"
        out = [(f"secretsmanager:{operation}", arn)]
        if operation == "CreateSecret" and req.get("Tags"):
            out.append(("secretsmanager:TagResource", arn))
        return out
    if service == "logs":
        group = req.get("logGroupName", "*")
        stream = req.get("logStreamName")
        arn = f"arn:aws:logs:{region}:{ACCOUNT}:log-group:{group}:" + (f"log-stream:{stream}" if stream else "*")
        return [(f"logs:{operation}", arn)]
    return [(f"{service}:{operation}", "*")]


def s3_actions(method: str, path: str, query: dict[str, list[str]], headers: Any, body: bytes) -> list[tuple[str, str]]:
    """(action, resource) pairs for a path-style S3 REST request."""
    bucket, _, key = urllib.parse.unquote(path.lstrip("/")).partition("/")
    bucket_arn, object_arn = f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/{key}"
    if not bucket:
        return [("s3:ListAllMyBuckets", "*")]
    if not key:
        if method == "POST" and "delete" in query:
            keys = re.findall(rb"<Key>(.*?)</Key>", body)
            return [("s3:DeleteObject", f"{bucket_arn}/{k.decode()}") for k in keys] or [("s3:DeleteObject", bucket_arn)]
        if method == "GET" and "location" in query:
            return [("s3:GetBucketLocation", bucket_arn)]
        if method == "GET" and "uploads" in query:
            return [("s3:ListBucketMultipartUploads", bucket_arn)]
        if method in ("GET", "HEAD"):
            return [("s3:ListBucket", bucket_arn)]
        return [({"PUT": "s3:CreateBucket", "DELETE": "s3:DeleteBucket"}.get(method, f"s3:{method}Bucket"), bucket_arn)]
    if method in ("GET", "HEAD"):
        return [("s3:ListMultipartUploadParts" if "uploadId" in query else "s3:GetObject", object_arn)]
    if method == "DELETE":
        return [("s3:AbortMultipartUpload" if "uploadId" in query else "s3:DeleteObject", object_arn)]
    out = [("s3:PutObject", object_arn)]  # PUT, POST ?uploads, ?uploadId: all PutObject
    source = headers.get("x-amz-copy-source")
    if source:
        out.append(("s3:GetObject", "arn:aws:s3:::" + urllib.parse.unquote(source.lstrip("/")).split("?")[0]))
    return out
