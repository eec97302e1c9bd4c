"""An image-and-text model's training settings (vision_freeze: training/freeze.py). Each check is a function of the
resolved values that raises ConfigError naming the fix; checks.CHECKS runs CHECKS. A text model given vision_freeze
is refused by features.FEATURES (the key belongs to models with a tower)."""

from __future__ import annotations

from maxtrain.errors import ConfigError

PARTS = ("tower", "projector", "language_model")  # what vision_freeze may name (training/freeze.py)


def _require(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def vision_freeze_parts(v):
    parts = v["vision_freeze"]
    _require(isinstance(parts, list) and all(p in PARTS for p in parts) and len(set(parts)) == len(parts),
             f"vision_freeze={parts!r} must list distinct parts among {', '.join(PARTS)} (e.g. [tower]: the projector "
             "and the language model train; [tower, language_model]: the projector alone, as LLaVA's first stage)")
    _require(set(parts) != set(PARTS), "vision_freeze=[tower, projector, language_model] freezes every weight: nothing "
                                       "would train; leave out the part to train")
    if v["lora_rank"] > 0:
        _require(set(parts) in (set(), {"tower", "projector"}),
                 f"vision_freeze={parts} with lora_rank={v['lora_rank']}: LoRA trains adapters of the language model "
                 "alone, the tower and the projector stay frozen as they are; set vision_freeze=[] (or lora_rank=0 to "
                 "train the parts vision_freeze leaves out)")
    _require(not parts or v["opt_type"] == "adamw",
             f"vision_freeze={parts} runs with opt_type=adamw only (opt_type={v['opt_type']!r}: Muon's split of the "
             "matrices is not masked by part yet); set opt_type=adamw")
    _require(not parts or v["indexer_training"] != "dense_warmup",
             "vision_freeze and indexer_training=dense_warmup both choose what trains; set one of them")


CHECKS = (vision_freeze_parts,)
