"""Which store each rendezvous URI opens, with which configuration; clear errors for bad ones.

s3:// runs end to end against moto and az:// against Azurite in the integration tests. No GCS
emulator that speaks the JSON/XML API obstore uses (with ETags and ifGenerationMatch) installs
here, so gs:// is tested to this mapping only; the README says so.
"""

from __future__ import annotations

import json

import pytest

from diloco.errors import UserError
from diloco.launching.rendezvous import check_rendezvous
from diloco.store.objectstore import open_store


@pytest.fixture
def gcs_key(tmp_path, monkeypatch):
    """A service-account key file that needs no network (object_store's emulator form)."""
    key = tmp_path / "sa.json"
    key.write_text(json.dumps({"gcs_base_url": "http://127.0.0.1:1", "disable_oauth": True, "client_email": "",
                               "private_key": "", "private_key_id": ""}))
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(key))
    return key


@pytest.mark.parametrize("uri, bucket, prefix", [
    ("gs://my-bucket/diloco/runs", "my-bucket", "diloco/runs"),
    ("gs://my-bucket", "my-bucket", None),
])
def test_gs_uris_open_a_gcs_store_on_the_bucket_and_prefix(gcs_key, uri, bucket, prefix):
    store = open_store(uri)
    assert type(store.raw).__name__ == "GCSStore"
    assert store.raw.config["bucket"] == bucket
    assert store.raw.prefix == prefix
    assert store.uri == uri


@pytest.mark.parametrize("uri, account, container, prefix", [
    ("az://runs/diloco", "fromenv", "runs", "diloco"),
    ("azure://runs/a/b", "fromenv", "runs", "a/b"),
    ("abfs://runs/diloco", "fromenv", "runs", "diloco"),
    ("abfss://runs@myacct.dfs.core.windows.net/diloco", "myacct", "runs", "diloco"),
    ("https://myacct.blob.core.windows.net/runs/diloco", "myacct", "runs", "diloco"),
    ("https://myacct.dfs.core.windows.net/runs/x/y", "myacct", "runs", "x/y"),
])
def test_azure_uris_in_every_form_open_the_container_and_prefix(monkeypatch, uri, account, container, prefix):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "fromenv")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "a2V5")
    store = open_store(uri)
    assert type(store.raw).__name__ == "AzureStore"
    assert store.raw.config["container_name"] == container
    assert store.raw.config.get("account_name", "fromenv") == account
    assert store.raw.prefix == prefix


def test_s3_uris_take_endpoint_and_region_from_the_aws_variables(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    store = open_store("s3://bkt/pre/fix")
    assert type(store.raw).__name__ == "S3Store"
    assert store.raw.config["bucket"] == "bkt" and store.raw.prefix == "pre/fix"
    assert store.raw.config["endpoint"] == "http://127.0.0.1:9" and store.raw.config["region"] == "eu-west-1"


@pytest.mark.parametrize("uri, message", [
    ("gs:///nobucket", "names no bucket: write gs://bucket/prefix"),
    ("az:///x", "names no container: write az://container/prefix"),
    ("https://example.com/x/y", "must be an Azure Blob URL"),
    ("https://myacct.blob.core.windows.net/", "names no container"),
    ("ftp://x/y", "unsupported scheme 'ftp'"),
])
def test_bad_cloud_uris_are_one_line(uri, message):
    with pytest.raises(UserError, match=message) as err:
        open_store(uri)
    assert "\n" not in str(err.value)


def test_missing_gcs_credentials_are_one_line_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(tmp_path / "missing.json"))
    with pytest.raises(UserError) as err:
        open_store("gs://bkt/p")
    text = str(err.value)
    assert "\n" not in text and "cannot open the store" in text and "GOOGLE_SERVICE_ACCOUNT" in text


@pytest.mark.parametrize("uri", ["gs://b/p", "az://c/p", "abfss://c@a.dfs.core.windows.net/p",
                                 "https://a.blob.core.windows.net/c/p"])
def test_cloud_uris_are_accepted_for_remote_backends(uri):
    assert check_rendezvous(uri, backend="eks", shared_disk=False, source="spec.toml") == uri


def test_cloud_credentials_are_treated_as_secrets():
    from diloco.inputs.replicaenv import is_secret_name

    for name in ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_KEY", "AZURE_CLIENT_SECRET",
                 "GOOGLE_SERVICE_ACCOUNT_KEY", "AZURE_STORAGE_TOKEN"):
        assert is_secret_name(name), name
    assert not is_secret_name("AZURE_STORAGE_ACCOUNT_NAME")
