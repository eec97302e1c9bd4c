"""Distillation's teacher: which model it is, and its frozen params (objectives.distill is the loss).

    config = distillation.adopt_teacher(config)   # once, with the config: the teacher's model settings
    teacher_config = distillation.teacher_config(config)
    builder.Run.init reads its params from distill_teacher_path, sharded like the student's

The teacher is a checkpoint (distill_teacher_path: a maxtrain run, or a Hugging Face model imported
with scripts/convert_hf.py); its model settings come from the checkpoint's metadata, so it may be
wider, deeper or of another family than the student, but it must predict the same vocabulary. The
settings are kept in the config as `distill_teacher_model` (the teacher's model keys), so every later
step (build, the ahead-of-time compiler, a resumed run) reads them from the config, not the disk.

In the train state the teacher is the entry "teacher", declared by its ParamSpecs and sharded by the
same logical axis rules as the student; it is no trainable entry: no gradient, no optimizer state. Its
checkpointed copy (every checkpoint holds it, as DPO's holds its reference) makes a resume exact.
"""

from __future__ import annotations

from maxtrain import config as config_lib
from maxtrain.models.model import Model
from maxtrain.models import model_keys
from maxtrain.checkpointing import files as checkpoint_files

KEY = "distill_teacher_model"  # the config's derived entry: the teacher's model keys


def adopt_teacher(config, log=print):
    """config with the teacher's model settings (from its checkpoint's metadata) as `distill_teacher_model`;
    unchanged when the objective holds no teacher (objective=distill's row does) or when already adopted.
    Refused before any other work when the
    teacher is missing, unreadable, or predicts another vocabulary than the student."""
    if config_lib.objectives.of(config).frozen != "teacher" or KEY in config:
        return config
    step_dir = checkpoint_files.find_step_dir(config.distill_teacher_path, "distill_teacher_path")
    saved = checkpoint_files.read_metadata(step_dir).get("config", {})
    missing = [k for k in model_keys.SHAPE_KEYS if k not in saved]
    if "decoder_block" not in saved or missing:
        raise checkpoint_files.CheckpointError(
            f"distill_teacher_path={config.distill_teacher_path!r}: the checkpoint {step_dir} records no model "
            f"settings ({', '.join(missing or ['decoder_block'])} missing from its metadata); use a checkpoint "
            "written by maxtrain.train or scripts/convert_hf.py")
    teacher = {k: saved[k] for k in model_keys.MODEL_KEYS if k in saved}
    if teacher["vocab_size"] != config.vocab_size:
        raise config_lib.ConfigError(
            f"the teacher {step_dir} predicts a vocabulary of {teacher['vocab_size']} tokens and the student "
            f"{config.vocab_size}; distillation compares their next-token distributions token by token, so both "
            "need the same tokenizer: use a teacher trained with the student's tokenizer (or the teacher's "
            f"tokenizer and vocab_size={teacher['vocab_size']} for the student)")
    config = type(config)({**config.to_dict(), KEY: teacher})
    t = teacher_config(config)
    offline = "distill_alpha" in config_lib.objectives.of(config).keys  # distill_on_policy reads neither key
    log(f"distillation teacher: {step_dir} ({t.decoder_block}, {Model.bind(t).num_params / 1e6:,.2f}M params, "
        f"{t.base_num_decoder_layers} layers, D {t.base_emb_dim})"
        + (f"  alpha {config.distill_alpha:g}  temperature {config.distill_temperature:g}" if offline else ""))
    return config


def teacher_model(config) -> Model:
    """The frozen teacher, bound (models/model.py): its family and layers from its own model keys."""
    return Model.bind(teacher_config(config))


def teacher_config(config):
    """The student's config with the teacher's model keys: what the teacher's forward pass reads."""
    return config.replace(**config.to_dict()[KEY])
