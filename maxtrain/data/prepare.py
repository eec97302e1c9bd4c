"""Prepare a corpus once: raw text -> tokenized ArrayRecord shards + metadata.json.

    python scripts/prepare_data.py --input 'raw/*.jsonl.zst' --tokenizer tok.model --output-dir data/web

The inputs are cut into work units (a file; a byte range of a large uncompressed .jsonl or line-mode
.txt file; a run of parquet row groups), about --shard-mb each. Worker processes tokenize the units
in parallel; unit i becomes train-<i>-of-<n>.arrayrecord (and eval-<i>-of-<n>.arrayrecord when
--eval-fraction > 0: a document goes to eval by a hash of its text, so the split does not depend on
the sharding). A finished unit leaves a marker in <output-dir>/.prepare/, so a re-run (after a crash,
or with more inputs appended) skips it. metadata.json is written last.

No JAX here: workers start fast and never fork a multithreaded JAX process.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time

from maxtrain import storage
from maxtrain.data import prepared, text_files, worker_processes
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.data.errors import DataError

_ENCODE_BATCH = 256  # documents tokenized per call


# --------------------------------------------------------------------------------------------
# Inputs and work units
# --------------------------------------------------------------------------------------------


def expand_inputs(patterns: list[str]) -> list[str]:
    files = []
    for pattern in patterns:
        matched = sorted(os.path.abspath(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True)
                         if os.path.isfile(p))
        if not matched:
            problem = text_files.unmatched(pattern)
            fix = "" if os.path.isdir(os.path.expanduser(pattern)) else \
                ". Check the path (quote globs so the shell does not expand them)."
            raise DataError(f"--input {pattern!r} {problem}{fix}")
        files.extend(matched)
    seen = set()
    return [f for f in files if not (f in seen or seen.add(f))]


def plan_units(files: list[str], shard_bytes: int, txt_documents: str) -> list[dict]:
    """Work units, in a deterministic order: the same inputs give the same units and shard names."""
    units = []
    for path in files:
        fmt, compression = text_files.file_format(path)
        size = storage.size(path)
        if fmt == "parquet":
            meta = text_files.open_parquet(path).metadata
            group, groups, total = 0, [], 0
            for group in range(meta.num_row_groups):
                groups.append(group)
                total += meta.row_group(group).total_byte_size
                if total >= shard_bytes:
                    units.append({"path": path, "row_groups": groups, "bytes": total})
                    groups, total = [], 0
            if groups or not units or units[-1]["path"] != path:
                units.append({"path": path, "row_groups": groups, "bytes": total})
        elif compression is None and (fmt == "jsonl" or txt_documents == "line") and size > shard_bytes:
            for start in range(0, size, shard_bytes):
                units.append({"path": path, "byte_range": [start, min(start + shard_bytes, size)],
                              "bytes": min(shard_bytes, size - start)})
        else:
            units.append({"path": path, "bytes": size})
    return units


def _shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.arrayrecord"


def _is_eval(text: str, fraction: float) -> bool:
    if fraction <= 0:
        return False
    digest = int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "little")
    return digest / 2**64 < fraction


# --------------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------------

_worker: dict = {}


def init_worker(tokenizer, progress_counter) -> None:
    """Pool initializer: the tokenizer arrives pickled (as its files' bytes), once per worker process."""
    _worker["tokenizer"] = tokenizer
    _worker["progress"] = progress_counter
    worker_processes.exit_with_parent()


def _report(delta: int) -> None:
    counter = _worker.get("progress")
    if counter is not None and delta:
        with counter.get_lock():
            counter.value += delta


def process_unit(job: dict) -> dict:
    """Tokenizes one unit into its shard(s); returns its marker (counts per written shard)."""
    tok = _worker["tokenizer"]
    unit, settings = job["unit"], job["settings"]
    dtype = settings["token_dtype"]
    records = {"train": [], "eval": []}
    tokens = {"train": 0, "eval": 0}
    empty = 0

    def flush(texts):
        for text, ids in zip(texts, tok.encode_batch(texts)):
            split = "eval" if _is_eval(text, settings["eval_fraction"]) else "train"
            doc = tokenizer_lib.document(tok, ids)
            records[split].append(prepared.encode_record(doc, dtype))
            tokens[split] += len(doc)

    pending = []
    for text in text_files.read_texts(unit["path"], settings["text_field"], settings["txt_documents"],
                                      byte_range=unit.get("byte_range"), row_groups=unit.get("row_groups"),
                                      progress=_report, field_key=job.get("field_key", "--text-field")):
        if not text.strip():
            empty += 1
            continue
        pending.append(text)
        if len(pending) == _ENCODE_BATCH:
            flush(pending)
            pending = []
    flush(pending)

    shards = {}
    for split in ("train", "eval"):
        if records[split]:  # an empty shard is never written
            name = _shard_name(split, job["index"], job["count"])
            local = os.path.join(job["output_dir"], name)
            prepared.write_shard(local, records[split])
            if job.get("publish_dir"):  # a gs:// cache: ArrayRecord writes local files, GCS gets the whole shard
                storage.upload(local, storage.join(job["publish_dir"], name))
                os.remove(local)
            shards[name] = {"split": split, "documents": len(records[split]), "tokens": tokens[split],
                            "source": unit["path"]}
    marker = {"index": job["index"], "unit": unit, "settings": settings, "shards": shards, "empty_documents": empty}
    _write_json(job["marker"], marker)
    return marker


def _write_json(path: str, data: dict) -> None:
    storage.write_text(path, json.dumps(data, indent=1))  # atomic: a marker is never half written


# --------------------------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------------------------


class ProgressBar:
    """One line on stderr: bar, percent, bytes done/total, rate, shards, ETA. Redrawn in place."""

    def __init__(self, total_bytes: int, total_units: int, stream=None):
        self.total, self.units, self.stream = max(total_bytes, 1), total_units, stream or sys.stderr
        self.start = time.time()
        self.interactive = self.stream.isatty()
        self.last_print = 0.0

    def draw(self, done_bytes: int, done_units: int, final: bool = False) -> None:
        now = time.time()
        if not final and not self.interactive and now - self.last_print < 10:
            return  # logs get a line every 10 s, terminals a live bar
        self.last_print = now
        done_bytes = min(done_bytes, self.total)  # a range's last line may run past its end
        frac = done_bytes / self.total
        rate = done_bytes / max(now - self.start, 1e-6)
        eta = (self.total - done_bytes) / rate if rate > 0 and not final else 0
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = (f"[{bar}] {100 * frac:5.1f}%  {done_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB  "
                f"{rate / 1e6:,.2f} MB/s  shards {done_units}/{self.units}  "
                f"{'elapsed' if final else 'ETA'} {datetime.timedelta(seconds=int(now - self.start if final else eta))}")
        end = "\n" if final or not self.interactive else ""
        self.stream.write(("\r" if self.interactive else "") + line + end)
        self.stream.flush()


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _parse(argv):
    p = argparse.ArgumentParser(prog="prepare_data.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", action="append", required=True,
                   help="glob of .txt/.jsonl/.parquet files (.gz/.zst allowed); repeat for more")
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model, Hugging Face tokenizer.json, or a directory "
                   "holding them (an HF model directory); make one with train_tokenizer.py")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    p.add_argument("--txt-documents", default="file", choices=text_files.TXT_DOCUMENTS,
                   help=".txt: one document per file, line, or blank-line separated paragraph")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="fraction of documents held out as eval-* shards")
    p.add_argument("--shard-mb", type=float, default=256.0, help="input megabytes per work unit / output shard")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier preparation in --output-dir made with other settings (another tokenizer)")
    return p.parse_args(argv)


def _previous_settings(out: str) -> dict | None:
    """The settings an earlier preparation of `out` used (its metadata.json, else any unit marker)."""
    try:
        meta = prepared.read_metadata(out) if os.path.isfile(os.path.join(out, prepared.METADATA)) else None
    except DataError:
        meta = None
    if meta:
        return {"tokenizer_checksum": meta["tokenizer"]["checksum"], "text_field": meta.get("text_field"),
                "txt_documents": meta.get("txt_documents"), "eval_fraction": meta.get("eval_fraction"),
                "token_dtype": meta.get("token_dtype"), "tokenizer": meta["tokenizer"].get("prepared_with")}
    markers = sorted(glob.glob(os.path.join(out, ".prepare", "unit-*.json")))
    for path in markers:
        marker = _read_marker(path)
        if marker and isinstance(marker.get("settings"), dict):
            return dict(marker["settings"])
    return None


def _clear(out: str) -> None:
    """Removes an earlier preparation: metadata.json first, so no reader ever sees a mix of the two."""
    for name in (prepared.METADATA, prepared.TOKENIZER):
        if os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    shutil.rmtree(os.path.join(out, ".prepare"), ignore_errors=True)
    for name in os.listdir(out):
        if name.endswith(".arrayrecord"):
            os.remove(os.path.join(out, name))


def _check_output_dir(out: str, settings: dict, tokenizer_path: str, overwrite: bool) -> None:
    previous = _previous_settings(out) if os.path.isdir(out) else None
    if previous is None:
        return
    differing = [k for k in ("tokenizer_checksum", "text_field", "txt_documents", "eval_fraction")
                 if k in previous and previous[k] != settings[k]]
    if overwrite:
        print(f"prepare_data: --overwrite: removing the earlier preparation in {out}", file=sys.stderr)
        _clear(out)
        return
    if "tokenizer_checksum" in differing:
        raise DataError(f"--output-dir {out} was prepared with another tokenizer (checksum "
                        f"{previous['tokenizer_checksum']}{', ' + previous['tokenizer'] if previous.get('tokenizer') else ''}"
                        f"), not {tokenizer_path} (checksum {settings['tokenizer_checksum']}). Choose another "
                        "--output-dir, or pass --overwrite to replace that preparation.")
    if differing:
        shown = ", ".join(f"{k}: {previous[k]!r} -> {settings[k]!r}" for k in differing)
        raise DataError(f"--output-dir {out} was prepared with other settings ({shown}). Choose another "
                        "--output-dir, or pass --overwrite to replace that preparation.")


def main(argv: list[str] | None = None) -> dict:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if not 0.0 <= args.eval_fraction < 1.0:
        raise DataError(f"--eval-fraction={args.eval_fraction} must be in [0, 1)")
    if not (args.shard_mb > 0 and args.shard_mb < float("inf")):
        raise DataError(f"--shard-mb={args.shard_mb} must be a number > 0 (input megabytes per shard)")
    if args.workers < 1:
        raise DataError(f"--workers={args.workers} must be at least 1")
    storage.check_output(args.output_dir, False, f"--output-dir {args.output_dir}")  # before any input is read
    tok = tokenizer_lib.load(args.tokenizer, "--tokenizer")
    tokenizer_lib.warn_if_no_eos(tok, lambda line: print(f"prepare_data: {line}", file=sys.stderr))
    files = expand_inputs(args.input)
    units = plan_units(files, int(args.shard_mb * 1e6), args.txt_documents)
    out = args.output_dir
    settings = {"tokenizer_checksum": tok.checksum, "text_field": args.text_field,
                "txt_documents": args.txt_documents, "eval_fraction": args.eval_fraction,
                "token_dtype": prepared.token_dtype(tok.vocab_size)}
    _check_output_dir(out, settings, args.tokenizer, args.overwrite)
    os.makedirs(os.path.join(out, ".prepare"), exist_ok=True)

    markers, jobs = {}, []
    for i, unit in enumerate(units):
        marker = os.path.join(out, ".prepare", f"unit-{i:05d}-of-{len(units):05d}.json")
        done = _read_marker(marker)
        if (done and done["unit"] == unit and done["settings"] == settings
                and all(os.path.isfile(os.path.join(out, name)) for name in done["shards"])):
            markers[i] = done
        else:
            jobs.append({"index": i, "count": len(units), "unit": unit, "settings": settings, "output_dir": out,
                         "marker": marker})
    total = sum(u["bytes"] for u in units)
    print(f"prepare_data: {len(files)} files, {total / 1e6:,.1f} MB -> {len(units)} shards in {out} "
          f"({len(markers)} already done, {len(jobs)} to do, {min(args.workers, max(len(jobs), 1))} workers)",
          file=sys.stderr)

    if jobs:
        bar = ProgressBar(sum(j["unit"]["bytes"] for j in jobs), len(units))
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
        counter = context.Value("q", 0)
        if args.workers <= 1:  # in this process: no start-up cost for small inputs
            init_worker(tok, counter)
            for job in jobs:
                markers[job["index"]] = process_unit(job)
                bar.draw(counter.value, len(markers))
        else:
            with context.Pool(min(args.workers, len(jobs)), init_worker, (tok, counter)) as pool:
                results = pool.imap_unordered(process_unit, jobs)
                while len(markers) < len(units):
                    try:
                        marker = results.next(timeout=0.5)
                    except multiprocessing.TimeoutError:
                        bar.draw(counter.value, len(markers))
                        continue
                    markers[marker["index"]] = marker
                    bar.draw(counter.value, len(markers))
        bar.draw(counter.value, len(markers), final=True)

    tok.write(os.path.join(out, prepared.tokenizer_copy_name(tok)))
    metadata = make_metadata(args, tok, files, [markers[i] for i in range(len(units))], settings)
    _write_json(os.path.join(out, prepared.METADATA), metadata)
    stale = sorted(set(n for n in os.listdir(out) if n.endswith(".arrayrecord")) - set(metadata["shards"]))
    if stale:
        print(f"prepare_data: warning: {len(stale)} .arrayrecord files in {out} are not part of this preparation "
              f"(e.g. {stale[0]}); delete them so that globs do not pick them up", file=sys.stderr)
    for split, s in metadata["splits"].items():
        print(f"prepare_data: {split}: {s['documents']:,} documents, {s['tokens']:,} tokens in {s['shards']} shards",
              file=sys.stderr)
    return metadata


def _read_marker(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def make_metadata(args, tok, files, markers, settings) -> dict:
    shards = {name: entry for m in markers for name, entry in m["shards"].items()}
    splits = {}
    for entry in shards.values():
        s = splits.setdefault(entry["split"], {"documents": 0, "tokens": 0, "shards": 0})
        s["documents"] += entry["documents"]
        s["tokens"] += entry["tokens"]
        s["shards"] += 1
    return {
        "format": prepared.FORMAT, "version": prepared.VERSION,
        "record": f"one document per record: [bos, tokens..., eos] as little-endian {settings['token_dtype']}",
        "token_dtype": settings["token_dtype"],
        "tokenizer": {"checksum": tok.checksum, "kind": tok.kind, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                      "eos_id": tok.eos_id, "pad_id": tok.pad_id, "file": prepared.tokenizer_copy_name(tok),
                      "prepared_with": os.path.abspath(args.tokenizer)},
        "text_field": args.text_field, "txt_documents": args.txt_documents, "eval_fraction": args.eval_fraction,
        "sources": [{"path": storage.abspath(f), "bytes": storage.size(f)} for f in files],
        "empty_documents_skipped": sum(m["empty_documents"] for m in markers),
        "splits": splits, "shards": shards,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
