"""Files on local disk or on Google Cloud Storage (gs://), through one small set of functions.

    storage.glob("gs://bucket/raw/*.jsonl")       sorted matches, with their gs:// prefix
    with storage.open(path, "rb") as f: ...        a local file or a GCS object (seekable when read)
    storage.write_bytes(path, data)               whole-file writes: atomic locally (temp + rename),
                                                  atomic on GCS by nature (an object appears whole)
    storage.check_output(path, is_file, name)     an output that could not be written, refused before any
                                                  work (every tool's outputs go through it)

A local path goes to `os` and `glob`; a gs:// path to gcsfs (the optional `gcs` extra:
pip install 'maxtrain[gcs]'). Orbax (checkpoints) and tensorboardX reach GCS on their own and
need none of this. GCS has no append and no rename: callers that append (the metrics file)
rewrite the whole object, and callers that publish a finished file write it in one piece.

gcsfs is imported with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false unless the environment says
otherwise: maxtrain reads and writes whole objects, and the check for hierarchical-namespace
buckets costs a round trip to a separate Google service before each operation.

Local testing against an emulator (docs/storage.md): set STORAGE_EMULATOR_HOST (gcsfs, tensorboardX,
Orbax's bucket queries) and TENSORSTORE_GCS_HTTP_URL + GOOGLE_AUTH_TOKEN_FOR_TESTING (Orbax's
TensorStore writes).
"""

from __future__ import annotations

import builtins
import functools
import glob as glob_lib
import logging
import os
import shutil
import tempfile

from maxtrain.errors import PathError, UserError, install_hint

GCS = "gs://"


class StorageError(UserError, OSError):
    """A path that cannot be used (gs:// without gcsfs); the message says why and what to do."""


def is_remote(path: str) -> bool:
    return str(path).startswith(GCS)


@functools.lru_cache(maxsize=1)
def _gcs():
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        import gcsfs  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise StorageError(f"gs:// paths need gcsfs: {install_hint('gcsfs')}") from None
    # gcsfs logs a traceback when it gives up on a request, then raises the same error, which the
    # caller reports with what to do; the log would only bury that message.
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    return gcsfs.GCSFileSystem()


def _with_scheme(path: str) -> str:
    return path if path.startswith(GCS) else GCS + path


def join(*parts: str) -> str:
    return os.path.join(*parts)  # "gs://b/x" + "y" -> "gs://b/x/y"


def abspath(path: str) -> str:
    return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def glob(pattern: str) -> list[str]:
    """Files (not directories) matching `pattern`, sorted; `**` matches any depth."""
    if is_remote(pattern):
        fs = _gcs()
        return sorted(_with_scheme(p) for p in fs.glob(pattern) if fs.isfile(p))
    return sorted(p for p in glob_lib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))


def open(path: str, mode: str = "rb", **kwargs):  # pylint: disable=redefined-builtin
    if is_remote(path):
        return _gcs().open(path, mode, **kwargs)
    return builtins.open(path, mode, **kwargs)  # pylint: disable=unspecified-encoding


def exists(path: str) -> bool:
    return _gcs().exists(path) if is_remote(path) else os.path.exists(path)


def isfile(path: str) -> bool:
    return _gcs().isfile(path) if is_remote(path) else os.path.isfile(path)


def isdir(path: str) -> bool:
    return _gcs().isdir(path) if is_remote(path) else os.path.isdir(path)


def size(path: str) -> int:
    return int(_gcs().info(path)["size"]) if is_remote(path) else os.path.getsize(path)


def signature(path: str) -> dict:
    """What identifies this version of a file without reading it: size and modification time (ns)
    on disk; size and the CRC32C checksum that GCS keeps of every object's content."""
    if is_remote(path):
        info = _gcs().info(path)
        return {"size": int(info["size"]), "crc32c": info.get("crc32c") or info.get("md5Hash") or info.get("generation")}
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def listdir(path: str) -> list[str]:
    """Names (not paths) in a directory, sorted; [] when it does not exist."""
    if is_remote(path):
        fs = _gcs()
        if not fs.exists(path):
            return []
        fs.invalidate_cache(path)
        return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def place_problem(path: str, is_file: bool) -> str | None:
    """Why a file (is_file) or directory could not be made or written at the local `path`, as words that
    follow the path ("is a file, not a directory; choose a directory"); None when it can, or for gs://
    (a bucket answers on the first write)."""
    if is_remote(path):
        return None
    path = os.path.abspath(os.path.expanduser(path))
    if is_file and os.path.isdir(path):
        return "is a directory; give a file path"
    if not is_file and os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory; choose a directory"
    existing = os.path.dirname(path) if is_file else path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is a file, not a directory. Choose a path inside a directory"
    target = path if os.path.exists(path) else existing
    if not os.access(target, os.W_OK | (os.X_OK if os.path.isdir(target) else 0)):
        return f"cannot be written: no write permission on {target}. Choose a writable path"
    return None


def check_output(path: str, is_file: bool, name: str | None = None, hint: str = "") -> None:
    """Refuses now, before any work, an output that could not be written at `path`, a file (is_file) or a
    directory: a PathError "<name> <problem and fix><hint>", where `name` is the path as the user gave it
    ("--output-dir out", "metrics_file='/x/m.jsonl'"; the path itself by default). The one check of every
    tool's outputs (place_problem: a file in the way, a directory where a file goes or the reverse, no
    permission); gs:// paths are left to their first write."""
    problem = place_problem(path, is_file)
    if problem:
        raise PathError(f"{name or path} {problem}{hint}")


def makedirs(path: str) -> None:
    if not is_remote(path):  # GCS has no directories: an object's name makes them
        os.makedirs(path, exist_ok=True)


def write_bytes(path: str, data: bytes) -> None:
    """Writes a whole file so that no reader ever sees part of it."""
    if is_remote(path):
        with _gcs().open(path, "wb") as f:
            f.write(data)
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def upload(local_path: str, path: str) -> None:
    """Copies a finished local file to `path` (local or gs://) as one whole write."""
    if is_remote(path):
        _gcs().put_file(local_path, path)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = os.path.join(os.path.dirname(os.path.abspath(path)), ".tmp-" + os.path.basename(path))
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, path)


def download(path: str, local_path: str) -> None:
    """Copies a gs:// object to a local file (written under a temporary name, then renamed)."""
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    tmp = local_path + ".part"
    _gcs().get_file(path, tmp)
    os.replace(tmp, local_path)


def rmtree(path: str) -> None:
    if is_remote(path):
        fs = _gcs()
        if fs.exists(path):
            fs.rm(path, recursive=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def move(path: str, target: str) -> None:
    """Renames a file or directory (on GCS, copies then deletes the objects under `path`)."""
    if is_remote(path):
        _gcs().mv(path, target, recursive=True)
    else:
        os.rename(path, target)
