"""A report written while it is measured, under a wall-time budget (scripts/gpu_report.py).

    report = Report(out_dir, budget_seconds=420, title="...", header={...})
    part = report.part("speed", share=0.25, columns=[("impl", "implementation", "{}"), ...])
    row = part.run("flash T8192", kind="speed", estimate=8.0, measure=lambda: {...})

Parts run in order, each within its share of the budget: part i may run until start + (shares of
parts 0..i) x budget, so time a part leaves unused passes to the next, and a part that overran
leaves the next one less. Before an item starts, its cost is estimated (the estimate given, or the
latest item of the same kind, whichever is larger; the first item of a kind is left out, since it pays
the process' one-time costs: on an H200 the model part's first item took 73 s, the next four 3 to 12 s
each, 2026-11-26); an item that would not end within the
part's time is skipped and listed as such, so cheap items later in a part still run. An item that
raises becomes a row with its error; the report goes on.

report.json and report.md are rewritten after every item: a run cut short leaves everything it
measured. A watchdog (start_watchdog) writes them one last time, naming the item still running, and
ends the process when the budget and a grace period have both run out (a compile that hangs).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import traceback
from typing import Callable

WATCHDOG_EXIT_STATUS = 3


class Part:
    """One part of a report: its rows, the items it skipped, and its time."""

    def __init__(self, report: "Report", name: str, deadline: float, share_seconds: float, columns: list,
                 note: str = ""):
        self.report, self.name, self.deadline, self.share_seconds = report, name, deadline, share_seconds
        self.columns, self.note = columns, note
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.started = report.clock()
        self.ended: float | None = None  # when the next part began, or the report finished
        self.latest: dict[str, float] = {}   # seconds of the latest item of each kind (not the first)
        self.count: dict[str, int] = {}

    def seconds(self) -> float:
        return (self.ended if self.ended is not None else self.report.clock()) - self.started

    def seconds_left(self) -> float:
        return self.deadline - self.report.clock()

    def run(self, label: str, measure: Callable[[], dict], *, kind: str = "", estimate: float = 0.0) -> dict | None:
        """measure() -> a row (dict), unless the item's estimated seconds exceed what the part has left;
        its row (or its error) is added and the report rewritten. Returns the row, None when skipped."""
        expected = max(estimate, self.latest.get(kind, 0.0))
        left = self.seconds_left()
        if expected > left:
            self.skip(label, f"the part's share ran out ({max(left, 0):.0f} s left, about {expected:.0f} s needed)")
            return None
        self.report.running = f"{self.name}: {label}"
        start = self.report.clock()
        try:
            row = {"item": label, **measure()}
        except Exception as error:  # pylint: disable=broad-except  # a failed measurement is a result
            lines = traceback.format_exception_only(type(error), error)
            row = {"item": label, "error": " ".join(" ".join(lines).split())[:600]}
        seconds = self.report.clock() - start
        self.count[kind] = self.count.get(kind, 0) + 1
        if self.count[kind] > 1:
            self.latest[kind] = seconds
        row["seconds"] = round(seconds, 2)
        self.report.running = None
        self.add(row)
        return row

    def add(self, row: dict) -> None:
        """Adds a finished row, prints it and rewrites the report."""
        self.rows.append(row)
        self.report.progress(f"{self.name}: {self.report.summary(self, row)}")
        self.report.write()

    def skip(self, label: str, reason: str) -> None:
        self.skipped.append({"item": label, "reason": reason})
        self.report.progress(f"{self.name}: skipped {label}: {reason}")
        self.report.write()

    def to_json(self) -> dict:
        return {"name": self.name, "note": self.note, "share_seconds": round(self.share_seconds, 1),
                "seconds": round(self.seconds(), 1), "rows": self.rows, "skipped": self.skipped}


class Report:
    """Parts measured in order under `budget_seconds`, written to out_dir/report.json and report.md."""

    def __init__(self, out_dir: str, budget_seconds: float, title: str, header: dict, start: float | None = None,
                 clock=time.monotonic, log=print):
        """start: when the budget began (a `clock()` reading, e.g. the process' start); default now."""
        self.out_dir, self.budget_seconds, self.title, self.header = out_dir, budget_seconds, title, header
        self.clock, self.log = clock, log
        self.start = clock() if start is None else start
        self.allotted = 0.0  # shares of the parts begun so far
        self.parts: list[Part] = []
        self.running: str | None = None
        self.finished = False
        self._lock = threading.Lock()
        os.makedirs(out_dir, exist_ok=True)

    def elapsed(self) -> float:
        return self.clock() - self.start

    def part(self, name: str, share: float, columns: list, note: str = "") -> Part:
        """Begins the next part: it may run until the end of its share (see the module's docstring).
        columns: (key, header, format) of its markdown table; the JSON keeps every key of a row."""
        if self.parts:
            self.parts[-1].ended = self.clock()
        self.allotted += share
        deadline = self.start + min(self.allotted, 1.0) * self.budget_seconds
        part = Part(self, name, deadline, deadline - self.clock(), columns, note)
        self.parts.append(part)
        self.progress(f"{name}: begins, {max(part.share_seconds, 0):.0f} s of the budget for it")
        self.write()
        return part

    def progress(self, line: str) -> None:
        self.log(f"[{self.elapsed():6.1f} s] {line}", flush=True)

    @staticmethod
    def summary(part: Part, row: dict) -> str:
        if "error" in row:
            return f"{row['item']}: failed: {row['error'][:300]}"
        return f"{row['item']}: " + " | ".join(cell(row.get(key), fmt) for key, _, fmt in part.columns)

    def to_json(self) -> dict:
        return {"title": self.title, **self.header, "budget_seconds": self.budget_seconds,
                "elapsed_seconds": round(self.elapsed(), 1), "finished": self.finished, "running": self.running,
                "parts": [p.to_json() for p in self.parts]}

    def markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        lines += [f"- {key}: {value}" for key, value in self.header.items()]
        state = "finished" if self.finished else f"not finished (running: {self.running or 'between items'})"
        lines += [f"- elapsed: {self.elapsed():.0f} s of a {self.budget_seconds:.0f} s budget; {state}", ""]
        for part in self.parts:
            lines += [f"## {part.name}", ""]
            if part.note:
                lines += [part.note, ""]
            lines += [f"{len(part.rows)} items in {part.seconds():.0f} s "
                      f"(share {max(part.share_seconds, 0):.0f} s)", ""]
            if part.rows:
                lines.append("| item | " + " | ".join(h for _, h, _ in part.columns) + " | s |")
                lines.append("| --- " * (len(part.columns) + 2) + "|")
                for row in part.rows:
                    if "error" in row:
                        cells = [f"failed: {row['error'][:300]}"] + [""] * (len(part.columns) - 1)
                    else:
                        cells = [cell(row.get(key), fmt) for key, _, fmt in part.columns]
                    lines.append(f"| {row['item']} | " + " | ".join(c.replace("|", "/") for c in cells)
                                 + f" | {row.get('seconds', '')} |")
                lines.append("")
            for skip in part.skipped:
                lines.append(f"- skipped {skip['item']}: {skip['reason']}")
            if part.skipped:
                lines.append("")
        return "\n".join(lines)

    def write(self) -> None:
        """Rewrites report.json and report.md (each through a temporary file, so neither is ever half written)."""
        with self._lock:
            for name, text in (("report.json", json.dumps(self.to_json(), indent=1, default=str)),
                               ("report.md", self.markdown())):
                path = os.path.join(self.out_dir, name)
                with open(path + ".tmp", "w", encoding="utf-8") as f:
                    f.write(text + "\n")
                os.replace(path + ".tmp", path)

    def finish(self) -> None:
        if self.parts:
            self.parts[-1].ended = self.clock()
        self.finished = True
        self.write()

    def start_watchdog(self, grace_seconds: float) -> threading.Timer:
        """Once budget + grace seconds have passed: writes the report, naming the item still running, and
        ends the process (exit status 3)."""
        def expire():
            if self.finished:
                return
            self.progress(f"budget and grace ({self.budget_seconds:.0f} + {grace_seconds:.0f} s) ran out while "
                          f"running {self.running or 'between items'}; writing the report and stopping")
            self.write()
            os._exit(WATCHDOG_EXIT_STATUS)  # pylint: disable=protected-access

        timer = threading.Timer(max(self.budget_seconds + grace_seconds - self.elapsed(), 0), expire)
        timer.daemon = True
        timer.start()
        return timer


def cell(value, fmt: str) -> str:
    """A table cell: '' for None, the value through fmt, NaN and inf as text."""
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)
