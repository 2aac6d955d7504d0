"""A real Azure Blob API for tests: Azurite (Microsoft's emulator, the npm package) on 127.0.0.1.

Stand-in, not a double: obstore in the launcher and in every replica process talks to it over
HTTP with Shared Key auth exactly as it would to a storage account; the container is created
with Microsoft's own client (azure-storage-blob). Needs the `azurite-blob` command (`npm install
azurite`; `.ci/run` installs it) and azure-storage-blob (a test dependency, imported here only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

from .s3server import free_port

# Azurite's one built-in account: its name and key are public, documented defaults.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_command() -> str | None:
    """The `azurite-blob` executable: $DILOCO_AZURITE, else on PATH."""
    return os.environ.get("DILOCO_AZURITE") or shutil.which("azurite-blob")


@contextmanager
def azurite(container: str = "diloco-test", prefix: str = "runs") -> Iterator[dict[str, Any]]:
    """Yields {"uri": az://container/prefix, "env": AZURE_* for processes, "client": ContainerClient,
    "endpoint"}; `env` splits into what a spec's [env] may carry and `secret_env` (the key)."""
    command = azurite_command()
    if command is None:
        raise RuntimeError("azurite-blob not found: `npm install azurite` and put node_modules/.bin on PATH "
                           "(or set DILOCO_AZURITE)")
    workdir, proc = tempfile.mkdtemp(prefix="azurite-"), None
    try:
        for tries_left in reversed(range(3)):  # a port free when picked may be taken before azurite binds it
            port = free_port()
            proc = subprocess.Popen([command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
                                     workdir, "--silent", "--skipApiVersionCheck", "--loose"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            endpoint = f"http://127.0.0.1:{port}"
            client = _container(endpoint, container, proc, retry_in_use=tries_left > 0)
            if client is not None:
                break
        env = {"AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT, "AZURE_STORAGE_USE_EMULATOR": "true",
               "AZURITE_BLOB_STORAGE_URL": endpoint}
        yield {"uri": f"az://{container}/{prefix}", "env": env,
               "secret_env": {"AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY}, "client": client, "endpoint": endpoint,
               "container": container}
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _container(endpoint: str, container: str, proc: subprocess.Popen, *, retry_in_use: bool):
    """Create `container` once azurite at `endpoint` answers; None if azurite found its port taken
    (and `retry_in_use`: the caller tries another port). Fails loudly otherwise."""
    from azure.storage.blob import BlobServiceClient

    conn = (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")
    service = BlobServiceClient.from_connection_string(conn)
    deadline = time.monotonic() + 60
    while True:
        try:
            return service.create_container(container)
        except Exception:
            if proc.poll() is not None:
                error = proc.stderr.read()[-2000:]
                if retry_in_use and "EADDRINUSE" in error:
                    return None
                raise RuntimeError(f"azurite exited: {error}") from None
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.2)
