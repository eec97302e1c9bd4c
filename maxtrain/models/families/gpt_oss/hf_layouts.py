"""gpt-oss's own Hugging Face tensor layout (models/hf.py has the Layout contract and the shared ones)."""

from __future__ import annotations

import dataclasses

from maxtrain.models.hf import Columns


@dataclasses.dataclass(frozen=True)
class Interleaved(Columns):
    """Columns part, part + parts, part + 2 parts, ...: gpt-oss's experts keep gate and up in one
    gate_up_proj [E, D, 2F], gate in the even columns and up in the odd ones."""

    def columns(self, width: int) -> slice:
        return slice(self.part, None, self.parts)
