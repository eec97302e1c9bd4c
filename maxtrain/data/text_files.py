"""Raw text files: what a document is in each format, read with errors that point at the line.

Formats, by file name (`.gz` or `.zst` after the name means compressed):
    .txt .text             txt_documents = "file": the whole file is one document (source code);
                           "line": each line; "paragraph": blocks separated by blank lines
    .jsonl .json .ndjson   one JSON object per line; the document is the string in field `field`
    .parquet               the document is the string column `field` (read one row group at a time)

`read_texts(path, ...)` yields one string per record (line, paragraph, row or file), "" for an empty
record, so a caller that counts records can resume with `skip=` exactly where it stopped. Bad
records raise DataError naming the file, the line (or row) and the fix. No JAX here: the
preparation workers import this module.
"""

from __future__ import annotations

import collections
import gzip
import io
import json
import os
from typing import Callable, Iterator

from maxtrain import storage
from maxtrain.data.errors import DataError

FORMATS = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
           ".parquet": "parquet"}
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
TXT_DOCUMENTS = ("file", "line", "paragraph")
_PROGRESS_EVERY = 1000  # records between progress callbacks


def file_format(path: str) -> tuple[str, str | None]:
    """(format, compression) from the file name."""
    name, compression = path.lower(), None
    for suffix, kind in COMPRESSIONS.items():
        if name.endswith(suffix):
            name, compression = name[:-len(suffix)], kind
            break
    for suffix, fmt in FORMATS.items():
        if name.endswith(suffix):
            if fmt == "parquet" and compression:
                raise DataError(f"{path}: parquet files compress their columns themselves; do not wrap them in "
                                f".gz/.zst (decompress it to a plain .parquet file)")
            return fmt, compression
    raise DataError(f"{path}: unknown file type. Name text files .txt, .jsonl or .parquet (.txt and .jsonl may "
                    "be compressed: .txt.gz, .jsonl.zst)")


def _format_of(name: str) -> str | None:
    """A file's format by its name (txt, jsonl, parquet, or arrayrecord: prepared data), None for any other."""
    if name.lower().endswith(".arrayrecord"):
        return "arrayrecord"
    try:
        return file_format(name)[0]
    except DataError:
        return None


def _extension(name: str) -> str:
    """'.jsonl.gz', '.arrayrecord', '.json': what a glob's `*` leaves to name such files."""
    lower = name.lower()
    compression = next((s for s in COMPRESSIONS if lower.endswith(s)), "")
    return os.path.splitext(lower[:len(lower) - len(compression)])[1] + compression


def unmatched(pattern: str, formats: tuple[str, ...] = (), prefix: str = "") -> str:
    """Why a glob matched no file, and the glob to write: a directory is said to be one, with a glob of its
    files (`DIR/train-*.arrayrecord`) and what it holds. `formats`: the formats wanted (txt, jsonl, parquet,
    arrayrecord; empty: raw text, as prepare_data and train_tokenizer read); `prefix`: a file-name prefix to
    suggest when such files have it."""
    wanted = formats or ("txt", "jsonl", "parquet")
    directory = pattern.rstrip("/") or pattern
    if not storage.isdir(directory):
        parent = os.path.dirname(pattern) or "."
        return "matches no files" + ("" if storage.isdir(parent) else f" (the directory {parent} does not exist)")
    names = [os.path.basename(p) for p in storage.glob(storage.join(directory, "*"))]
    deeper = [] if names else [p for p in storage.glob(storage.join(directory, "**", "*")) if _format_of(p) in wanted]
    held = collections.Counter(_extension(n) or "(no extension)" for n in names)
    holds = ("it holds " + ", ".join(f"{count} {ext}" for ext, count in held.most_common()) + " files" if names
             else "its files are in subdirectories" if deeper else "it holds no files")
    if "arrayrecord" not in wanted and any(_format_of(n) == "arrayrecord" for n in names):
        return ("is a directory of prepared (tokenized) data, " + (
            "not text: give the raw text files (.txt, .jsonl, .parquet)" if not formats else
            f"not {' or '.join(formats)} files: read it with dataset_type=arrayrecord and "
            f"'{storage.join(directory, prefix + '*.arrayrecord')}'"))
    fitting = [n for n in names if _format_of(n) in wanted]
    if fitting:
        ext = collections.Counter(_extension(n) for n in fitting).most_common(1)[0][0]
        stem = prefix if prefix and any(n.startswith(prefix) and _extension(n) == ext for n in fitting) else ""
        glob = storage.join(directory, f"{stem}*{ext}")
    elif deeper:
        glob = storage.join(directory, "**", f"*{_extension(deeper[0])}")
    else:
        return (f"is a directory without {' or '.join(wanted)} files ({holds}); give a glob of the data "
                f"files, e.g. '{storage.join(directory, '*.' + wanted[0])}'")
    return f"is a directory, not a glob of files: name its files, e.g. '{glob}' ({holds})"


def _zstandard():
    try:
        import zstandard  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise DataError("reading .zst files needs the zstandard package: pip install 'maxtrain[data]'") from None
    return zstandard


def pyarrow_parquet():
    try:
        import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    except ImportError:
        raise DataError("reading .parquet files needs the pyarrow package: pip install 'maxtrain[data]'") from None
    return pq


def open_parquet(path: str):
    """pyarrow's ParquetFile for a local path or a gs:// object (read through a seekable file object), or a
    DataError naming the file when it is not parquet."""
    pq = pyarrow_parquet()
    try:
        return pq.ParquetFile(storage.open(path, "rb") if storage.is_remote(path) else path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError variants  # pylint: disable=broad-except
        raise DataError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:200]}). Check the file (a "
                        "partial download? another format named .parquet?).") from None


def open_text(path: str, compression: str | None):
    """(stream of decompressed bytes, the raw file: its tell() is the progress in bytes on disk)."""
    try:
        raw = storage.open(path, "rb")  # pylint: disable=consider-using-with
    except FileNotFoundError:
        raise DataError(f"{path} does not exist (it was there when the file list was made; was it moved?)") from None
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw), raw
    if compression == "zstd":
        reader = _zstandard().ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader, 1 << 20), raw
    return raw, raw


def decode_text(data: bytes, where: str, unit: str = "line") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: invalid UTF-8 at byte offset {e.start} of the {unit} "
                        f"({data[e.start:e.start + 4]!r}). Re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t "
                        f"utf-8 in > out`) or remove the {unit}.") from None


def _where(path: str, line: int, offset: int, start: int) -> str:
    """A line's location: its number when counted from the file start, else its byte offset."""
    return f"{path} line {line}" if start == 0 else f"{path} (the line at byte {offset})"


def _lines(stream, path: str, start: int, end: int | None, skip: int, progress, raw):
    """(location, bytes) of each line whose first byte lies in [start, end), after `skip` lines."""
    if start:
        stream.seek(start - 1)
        stream.readline()  # the line holding byte start - 1 belongs to the previous range
    offset, number = stream.tell() if start else 0, 0
    while end is None or offset < end:
        line = stream.readline()
        if not line:
            break
        number += 1
        if number > skip:
            yield (number, offset), line
        offset += len(line)
        if progress and number % _PROGRESS_EVERY == 0:
            progress(raw.tell())


def naming(field_key: str) -> str:
    """How the user names the text field: `train_data_columns=[NAME]` (a config key) or `--text-field NAME`."""
    return f"{field_key}=[NAME]" if field_key.endswith("_columns") else f"{field_key} NAME"


def _jsonl(path, field, start, end, skip, progress, raw, stream, field_key) -> Iterator[str]:
    for (number, offset), line in _lines(stream, path, start, end, skip, progress, raw):
        where = _where(path, number, offset, start)
        text = decode_text(line, where).strip()
        if not text:
            yield ""
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}). Each line of a .jsonl file "
                            "must be one JSON object; fix or remove the line.") from None
        if not isinstance(record, dict) or field not in record:
            fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"{where}: no {field!r} field (the line has: {fields or 'no fields'}). Name the text "
                            f"field with {naming(field_key)}, or fix the line.")
        value = record[field]
        if value is None:
            yield ""
        elif not isinstance(value, str):
            raise DataError(f"{where}: field {field!r} holds a {type(value).__name__}, not a string")
        else:
            yield value


def _txt(path, mode, start, end, skip, progress, raw, stream) -> Iterator[str]:
    if mode == "file":
        if skip == 0:
            yield decode_text(stream.read(), path, "file")
        return
    paragraph, count = [], 0
    for (number, offset), line in _lines(stream, path, start, end, 0 if mode == "paragraph" else skip, progress, raw):
        text = decode_text(line, _where(path, number, offset, start)).rstrip("\r\n")
        if mode == "line":
            yield text
            continue
        if text.strip():
            paragraph.append(text)
        elif paragraph:
            count += 1
            if count > skip:
                yield "\n".join(paragraph)
            paragraph = []
    if paragraph and count + 1 > skip:
        yield "\n".join(paragraph)


def _parquet(path, field, row_groups, skip, progress, field_key) -> Iterator[str]:
    pf = open_parquet(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise DataError(f"{path}: no column {field!r} (columns: {', '.join(names)}). Name the text column with "
                        f"{naming(field_key)}.")
    groups = range(pf.num_row_groups) if row_groups is None else row_groups
    row = 0
    for group in groups:
        rows = pf.metadata.row_group(group).num_rows
        if skip >= rows:
            skip, row = skip - rows, row + rows
            continue
        column = pf.read_row_group(group, columns=[field]).column(0)
        kind = str(column.type)
        if kind not in ("string", "large_string", "binary", "large_binary"):
            raise DataError(f"{path}: column {field!r} has type {kind}, not string")
        for i, value in enumerate(column.to_pylist()[skip:], start=skip):
            if isinstance(value, bytes):
                value = decode_text(value, f"{path} row {row + i}", "value")
            yield value or ""
        skip, row = 0, row + rows
        if progress:
            progress(pf.metadata.row_group(group).total_byte_size)


def read_texts(path: str, field: str = "text", txt_documents: str = "file", skip: int = 0,
               byte_range: tuple[int, int | None] | None = None, row_groups: list[int] | None = None,
               progress: Callable[[int], None] | None = None, field_key: str = "--text-field") -> Iterator[str]:
    """The documents of one file, one string per record ("" for empty ones), after `skip` records.
    `field_key` is the setting that names `field` (train_data_columns, eval_data_columns, --text-field), for
    the message when a record lacks it.

    byte_range = (start, end) reads only the lines that start in [start, end) (uncompressed jsonl
    and line-mode txt); row_groups restricts a parquet file. `progress(bytes)` is called now and
    then with the bytes on disk consumed since the last call (parquet: each row group's size).
    """
    fmt, compression = file_format(path)
    if fmt == "parquet":
        yield from _parquet(path, field, row_groups, skip, progress, field_key)
        return
    if txt_documents not in TXT_DOCUMENTS:
        raise DataError(f"txt_documents={txt_documents!r}; use one of {', '.join(TXT_DOCUMENTS)}")
    start, end = byte_range or (0, None)
    stream, raw = open_text(path, compression)
    if progress:
        done = [start]

        def advanced(position, report=progress):
            report(position - done[0])
            done[0] = position

        progress = advanced
    with raw:
        if fmt == "jsonl":
            yield from _jsonl(path, field, start, end, skip, progress, raw, stream, field_key)
        else:
            yield from _txt(path, txt_documents, start, end, skip, progress, raw, stream)
        if progress:
            progress(raw.tell())


def check(path: str, field: str, field_key: str = "--text-field") -> None:
    """Fails now, before training, if `path` is empty or its first document cannot be read (`field_key`: as
    read_texts)."""
    fmt, _ = file_format(path)
    if fmt == "parquet":
        pf = open_parquet(path)
        if pf.metadata.num_rows == 0:
            raise DataError(f"{path} holds no rows: an empty shard. Delete it or narrow the glob.")
        names = pf.schema_arrow.names
        if field not in names:
            raise DataError(f"{path}: no column {field!r} (columns: {', '.join(names)}). Name the text column with "
                            f"{naming(field_key)}.")
        kind = str(pf.schema_arrow.field(field).type)
        if kind not in ("string", "large_string", "binary", "large_binary"):
            raise DataError(f"{path}: column {field!r} has type {kind}, not string; name a text column")
        return
    texts = read_texts(path, field, field_key=field_key)
    try:
        for text in texts:
            if text.strip():
                return
    finally:
        texts.close()
