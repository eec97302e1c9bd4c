"""Worker processes that end with the process that started them.

The dataset cache (cache.py), `prepare_data --workers N` (prepare.py) and Grain's `grain_worker_count` start worker
processes with multiprocessing's spawn method. A parent that exits normally stops them; a parent killed outright
(kill -9, the out-of-memory killer, a preempted job's SIGKILL) cannot, and its workers would wait for their next task
forever, holding memory and the parent's stdout and stderr (so that whoever reads the parent's output never sees it
end). `exit_with_parent`, run as the workers' initializer, ends them when the parent dies.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from multiprocessing import connection


def exit_with_parent(*_) -> None:
    """In a worker process: ends it as soon as its parent process dies. Does nothing in a process that is not a
    multiprocessing child. Extra arguments (Grain's worker index and count) are ignored."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        # The parent's sentinel is a pipe that only the parent holds open: it becomes readable when the parent dies.
        connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
