"""Self-checking checkpoints: a checksum of every file of a saved step, and the check against them.

Orbax 0.12 writes arrays through TensorStore's zarr3 driver with a crc32c codec on each shard's
*index* only, not on the chunk data (orbax/checkpoint/_src/serialization/tensorstore_utils.py,
`_build_zarr3_metadata`), and offers no option to add one; a flipped byte in an array's data
restores silently. So once Orbax has finished a step, each process hashes the files it wrote
(xxh3-64, read back from the page cache) into

    <step>/checksums/process_<i>.json     {"algorithm": "xxh3_64", "files": {relative path: {size, xxh3_64}}}

where xxh3_64 lists the hash of each 64 MiB piece of the file: the pieces are hashed by a pool of
threads (xxhash releases the GIL), so a few large files still use every core.

A file belongs to process i when its path has an `ocdbt.process_<i>` directory or a
`process_<i>` name (Orbax's and Grain's per-process files); every other file belongs to process 0.
`verify(step_dir)` re-hashes the listed files and names the first one that is missing, has another
size or other contents. A step without checksums/ (saved before maxtrain wrote them, or a run killed
between Orbax's finish and the checksum write) is "unverified": it is still used, and a restore
that fails on it falls back like a checksum mismatch (manager.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import re

DIRECTORY = "checksums"
# Orbax's own bookkeeping, which it rewrites after a step is complete (its commit timestamp): not hashed.
MUTABLE = ("_CHECKPOINT_METADATA",)
ALGORITHM = "xxh3_64"
_PIECE = 64 << 20  # bytes hashed as one piece
_WORKERS = min(8, os.cpu_count() or 1)
_OWNER = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:$|/|-of-)")


def owner(relative_path: str) -> int:
    """The process that wrote a file of a step directory (see the module docstring)."""
    found = _OWNER.search(relative_path)
    return int(found.group(1)) if found else 0


def _piece(path: str, offset: int) -> str:
    """The digest of the piece at `offset`, hashed in place through a memory map (a read() into a fresh
    64 MiB buffer costs 3-4x the hashing itself: page faults and a copy)."""
    import xxhash  # pylint: disable=import-outside-toplevel

    with open(path, "rb") as f:
        length = min(_PIECE, os.fstat(f.fileno()).st_size - offset)
        if length <= 0:
            return xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ, offset=offset) as view:
            return xxhash.xxh3_64_hexdigest(view)


def hash_files(paths: list[str]) -> dict[str, tuple[int, list[str]]]:
    """{path: (size, [xxh3-64 hex digest of each 64 MiB piece])}, the pieces hashed by a thread pool."""
    sizes = {p: os.path.getsize(p) for p in paths}
    pieces = [(p, offset) for p in paths for offset in range(0, max(sizes[p], 1), _PIECE)]
    with concurrent.futures.ThreadPoolExecutor(_WORKERS) as pool:
        digests = list(pool.map(lambda job: _piece(*job), pieces))
    out = {p: (sizes[p], []) for p in paths}
    for (p, _), digest in zip(pieces, digests):
        out[p][1].append(digest)
    return out


def hash_file(path: str) -> tuple[int, list[str]]:
    """(size, [xxh3-64 hex digest of each 64 MiB piece]) of one file."""
    return hash_files([path])[path]


def _files(step_dir: str) -> list[str]:
    out = []
    for root, dirs, names in os.walk(step_dir):
        rel_root = os.path.relpath(root, step_dir)
        if rel_root == DIRECTORY:
            dirs[:] = []
            continue
        dirs.sort()
        out += [os.path.normpath(os.path.join(rel_root, n)) for n in sorted(names)]
    return [f for f in out if not f.startswith(DIRECTORY + os.sep) and os.path.basename(f) not in MUTABLE]


def write(step_dir: str, process_index: int = 0, process_count: int = 1) -> str:
    """Hashes the files of `step_dir` this process wrote; writes checksums/process_<i>.json atomically."""
    mine = [f for f in _files(step_dir) if process_count == 1 or owner(f) % process_count == process_index]
    hashed = hash_files([os.path.join(step_dir, rel) for rel in mine])
    files = {rel: {"size": hashed[os.path.join(step_dir, rel)][0], ALGORITHM: hashed[os.path.join(step_dir, rel)][1]}
             for rel in mine}
    directory = os.path.join(step_dir, DIRECTORY)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"process_{process_index}.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"version": 1, "algorithm": ALGORITHM, "process": process_index, "files": files}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read(step_dir: str) -> dict[str, dict] | None:
    """{relative path: {size, xxh3_64}} of every checksum file of the step; None when it has none.

    A checksum file that cannot be read is itself damage: it is reported as a file entry that can
    never match.
    """
    directory = os.path.join(step_dir, DIRECTORY)
    if not os.path.isdir(directory):
        return None
    entries = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            files = data["files"] if data.get("algorithm") == ALGORITHM else None
            if not isinstance(files, dict):
                raise ValueError("no file list")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            entries[os.path.join(DIRECTORY, name)] = {"unreadable": True}
            continue
        entries.update(files)
    return entries


def verify(step_dir: str, share: tuple[int, int] = (0, 1), contents: bool = True) -> tuple[str, str | None, int]:
    """("verified" | "unverified" | "damaged", what is wrong (naming the file) or None, bytes checked).

    share = (i, n): check only every n-th listed file starting at i (processes split the reading).
    contents=False checks that every file is there with its size, without reading it (status "listed").
    """
    entries = read(step_dir)
    if entries is None:
        return "unverified", None, 0
    if not entries:
        return "damaged", f"{os.path.join(step_dir, DIRECTORY)} lists no files", 0
    index, count = share
    mine = [(rel, expected) for k, (rel, expected) in enumerate(sorted(entries.items())) if k % count == index]
    for rel, expected in mine:  # every file there, with its size, before anything is read
        path = os.path.join(step_dir, rel)
        if expected.get("unreadable"):
            return "damaged", f"{path}: the checksum file itself cannot be read", 0
        if not os.path.isfile(path):
            return "damaged", f"{path} is missing (it was saved with this step)", 0
        size = os.path.getsize(path)
        if size != expected.get("size"):
            return "damaged", f"{path} has {size} bytes, but {expected.get('size')} were saved", 0
    if not contents:
        return "listed", None, 0
    hashed = hash_files([os.path.join(step_dir, rel) for rel, _ in mine])
    for rel, expected in mine:
        path = os.path.join(step_dir, rel)
        if hashed[path][1] != expected.get(ALGORITHM):
            return "damaged", f"{path}: its contents changed since it was saved (checksum mismatch)", 0
    return "verified", None, sum(size for size, _ in hashed.values())
