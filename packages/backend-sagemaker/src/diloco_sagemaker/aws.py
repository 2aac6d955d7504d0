"""Talking to AWS for the sagemaker backend: the region, one boto3 client per service and region,
and AWS's errors turned into one line that names what failed and the fix.

Retries: botocore's "adaptive" mode with 10 attempts (or AWS_RETRY_MODE / AWS_MAX_ATTEMPTS
when this shell sets them). A throttle or a network error that outlasts them is `Transient`:
reading a status then answers the last one seen instead of stopping the launcher.

boto3 is imported on first use, never at import (`diloco backends` stays fast).
"""

from __future__ import annotations

import os
import re
from typing import Any

from diloco.errors import BackendError, UserError

from .options import SageMakerOptions


def console_url(region: str, job: str) -> str:
    return f"https://{region}.console.aws.amazon.com/sagemaker/home?region={region}#/jobs/{job}"


RETRY_MODE, MAX_ATTEMPTS = "adaptive", 10
# botocore's own list of throttling codes (botocore.retries.standard), and the server-side ones
TRANSIENT_CODES = {"Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
                   "TooManyRequestsException", "ProvisionedThroughputExceededException", "TransactionInProgressException",
                   "RequestLimitExceeded", "BandwidthLimitExceeded", "LimitExceededException", "RequestThrottled",
                   "SlowDown", "PriorRequestNotComplete", "EC2ThrottledException", "InternalFailure",
                   "InternalServerError", "InternalError", "ServiceUnavailable"}


class Transient(BackendError):
    """AWS is throttling or unreachable right now, beyond the retries: try again later."""


def is_transient(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return err.get("Code") in TRANSIENT_CODES or status >= 500
    return isinstance(exc, (ConnectionError, HTTPClientError))


def is_not_found(exc: BaseException) -> bool:
    """SageMaker's answer for a job it does not know (DescribeTrainingJob, StopTrainingJob)."""
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in (
        "ValidationException", "ResourceNotFound") and "not found" in str(exc).lower()


def retry_config() -> dict[str, Any]:
    return {"mode": os.environ.get("AWS_RETRY_MODE") or RETRY_MODE,
            "max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS") or MAX_ATTEMPTS)}


def _boto3():
    try:
        import boto3
    except ImportError:  # pragma: no cover - boto3 is a dependency of this package
        raise UserError("the sagemaker backend needs boto3: pip install diloco-backend-sagemaker") from None
    return boto3


class Aws:
    """The AWS side of one executor: clients made once, errors read with the options in mind."""

    def __init__(self, options: SageMakerOptions):
        self.options = options
        self._clients: dict[tuple[str, str], Any] = {}

    def region(self) -> str:
        if self.options.region:
            return self.options.region
        found = os.environ.get("AWS_REGION") or _boto3().session.Session().region_name  # boto3 reads only AWS_DEFAULT_REGION
        if not found:
            raise UserError("no AWS region: set [backend] region = \"us-east-1\" (or AWS_REGION in this shell)")
        return found

    def client(self, service: str, region: str | None = None) -> Any:
        region = region or self.region()
        key = (service, region)
        if key not in self._clients:
            from botocore.config import Config

            self._clients[key] = _boto3().session.Session().client(
                service, region_name=region, config=Config(retries=retry_config()))
        return self._clients[key]

    def call(self, what: str, fn, *args, **kwargs):
        """One AWS call, with AWS's errors turned into one line that names what failed and the fix."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError

        try:
            return fn(*args, **kwargs)
        except NoCredentialsError:
            raise UserError("no AWS credentials found: run `aws configure` or `aws sso login`, or set AWS_PROFILE "
                            "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) in this shell") from None
        except NoRegionError:
            raise UserError("no AWS region: set [backend] region (or AWS_REGION in this shell)") from None
        except ClientError as exc:
            if is_transient(exc):
                raise Transient(f"AWS {exc.operation_name} ({what}) is throttled or unavailable beyond "
                                f"{retry_config()['max_attempts']} attempts: {exc}") from None
            raise self.client_error(what, exc) from None
        except BotoCoreError as exc:
            if is_transient(exc):
                raise Transient(f"AWS unreachable ({what}) beyond {retry_config()['max_attempts']} attempts: "
                                f"{exc}") from None
            raise BackendError(f"AWS call failed ({what}): {exc}") from None

    def client_error(self, what: str, exc: Any) -> Exception:
        err = exc.response.get("Error", {})
        code, message = err.get("Code", ""), err.get("Message", str(exc))
        action = f"{exc.operation_name}"
        if code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
            return UserError(f"AWS denied {action} ({what}): {message}; allow it for the identity running diloco")
        if code in ("ExpiredToken", "ExpiredTokenException", "UnrecognizedClientException",
                    "InvalidClientTokenId", "InvalidSignatureException"):
            return UserError(f"AWS rejected this shell's credentials ({code}) on {action}: refresh them "
                             f"(`aws sso login`, or new keys)")
        if code == "ValidationException" and "assume" in message.lower():
            return UserError(f"SageMaker cannot assume role {self.options.role}: its trust policy must allow "
                             f"sagemaker.amazonaws.com, and the identity running diloco needs iam:PassRole on it "
                             f"({message})")
        if code == "ResourceLimitExceeded":
            found = re.search(r"ml\.[a-z0-9-]+\.[a-z0-9-]+", f"{message} {what}")
            instance = found.group(0) if found else "the instance type"
            usage = "spot training job usage" if self.options.spot else "training job usage"
            return UserError(f"SageMaker quota reached for {instance}: {message} Request more in Service Quotas "
                             f"('{instance} for {usage}'), or choose another instance type")
        if code in ("ValidationException", "ResourceInUse"):
            return UserError(f"SageMaker rejected {action} ({what}): {message}")
        return BackendError(f"AWS {action} failed ({what}): {code}: {message}")

    def describe(self, md: dict[str, Any]) -> dict[str, Any] | None:
        """DescribeTrainingJob for a handle's metadata; None for a job SageMaker does not know
        (yet: reads lag behind CreateTrainingJob), `Transient` while throttled or unreachable."""
        sm = self.client("sagemaker", md.get("region"))
        try:
            return self.call(f"describe {md['job']}", self._describe_or_none, sm, md["job"])
        except _NotFound:
            return None

    @staticmethod
    def _describe_or_none(sm: Any, name: str) -> dict[str, Any]:
        try:
            return sm.describe_training_job(TrainingJobName=name)
        except Exception as exc:
            if is_not_found(exc):
                raise _NotFound from None
            raise


class _NotFound(Exception):
    pass
