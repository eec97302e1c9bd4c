"""The bad-input rows of python -m maxtrain.inspect_checkpoint: what a user can give it wrong, and what it must answer."""

from __future__ import annotations

from bad_inputs.world import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import

ROWS = [
    # inspect_checkpoint
    Row("inspect-no-path", K, [], r"usage: python -m maxtrain.inspect_checkpoint PATH"),
    Row("inspect-path-missing", K, ["{scratch}/none"], r"path='.*/none' does not exist"),
    Row("inspect-no-checkpoints", K, ["{scratch}/nothing"], r"'.*/nothing' holds no complete checkpoint",
        setup=empty_dir),
    Row("inspect-bit-flipped", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/state/.*: its contents changed since it was saved", setup=flipped),
    Row("inspect-truncated", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .* has \d+ bytes, but \d+ were saved", setup=truncated),
    Row("inspect-file-deleted", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .* is missing \(it was saved with this step\)", setup=deleted),
    Row("inspect-state-deleted", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/checkpoints/4/state is missing", setup=no_state),
    Row("inspect-run-with-damaged-newest", K, ["{scratch}/run"],
        r"latest usable step: 2", code=0, setup=flipped),
    Row("inspect-garbage-metadata", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/metadata/metadata (has \d+ bytes, but|: its contents changed)",
        setup=garbage_metadata),
    Row("inspect-garbage-array-metadata", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/state/_METADATA (has \d+ bytes, but|: its contents changed)",
        setup=garbage_array_metadata),
    Row("inspect-garbage-checksums", K, ["{scratch}/run/checkpoints/4"],
        r"/checkpoints/4' is damaged: .*/checksums/process_0.json: the checksum file itself cannot be read",
        setup=garbage_checksums),
]
