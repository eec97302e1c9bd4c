"""Reading tensorboardX's event files back in the tests (observability, MoE metrics)."""

from __future__ import annotations

import glob
import struct


def read_tensorboard(directory):
    """(scalars {tag: [(step, value)]}, texts {tag: str}) from tensorboardX event files."""
    from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel

    scalars, texts = {}, {}
    for path in glob.glob(f"{directory}/events.out.tfevents.*"):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("tensor") and value.tensor.string_val:
                    texts[value.tag] = value.tensor.string_val[0].decode()
                else:
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars, texts
