"""What a run trains for: the `objective` key's rows, each declared once (data kind, frozen model, state, keys, checks).

    objectives.of(config).frozen        # "reference": DPO's frozen starting model ("" when it holds none)
    objectives.data_kind(config)        # "text" | "conversations" | "preference pairs" | "prompts"
    objectives.holds_frozen(config)     # whether the state holds the frozen model (GRPO with grpo_beta=0 does not)

`objective` (configs/base.yml) names one row of `OBJECTIVES`; a run has one objective because it is one
key. Every reader asks the row, never the objective's name: config/features.py (the keys a row owns are
refused under another objective; the chat template and SFT's weighting belong to the data kinds that use
them), config/checks.py (`CHECKS`: the data settings against the row's data kind and columns, then each
row's own rules; MTP and pipeline stages against `next_token` and `pipeline`), config/limits.py (a
sampled objective's sampler and prompt length), data.make_inputs (the data kind: text documents,
conversations and preference pairs through the chat template, GRPO's prompts), training/train_step.py
(the frozen model the state holds), training/builder.py (the batch's extra entries, the summary line)
and training/losses.py (the loss: `make` looks the loss function up by the row's name).

The old switches `use_sft`, `use_dpo`, `use_grpo` and `use_distillation` are read by config/loading.py
through `from_old_keys`: mapped to `objective=...` with one line of notice; two of them true, or one
contradicting `objective`, is refused naming both keys. A checkpoint's saved config that has them is read
through `saved_objective` (what `objective` it ran).

Adding an objective: a row here (with its keys in base.yml and its rules above the table), its loss in
training/losses.py (`LOSSES`), its data kind if it reads a new one (data.make_inputs), and a test.

Plain data and rules on resolved values: imports only the error type (no JAX).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from maxtrain.errors import ConfigError

# The data kinds: what a run's records are, and so how data.make_inputs reads them.
TEXT = "text"                      # documents (default corpus, arrayrecord, jsonl, parquet), packed
CONVERSATIONS = "conversations"    # chat records rendered with the chat template, weights on the assistant turns
PAIRS = "preference pairs"         # prompt, chosen and rejected completions, rendered with the chat template
PROMPTS = "prompts"                # prompts and their answers; completions are sampled as the run trains
RECORD_FILES = ("jsonl", "parquet")  # the dataset types that hold records with fields (all but text)


def _get(v, key: str) -> Any:
    """A value of resolved config values (a dict) or of a Config."""
    return v[key] if isinstance(v, dict) else getattr(v, key)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _columns_keys(v) -> tuple[str, ...]:
    """The *_data_columns keys a run reads: eval_data_columns only with eval files."""
    return ("train_data_columns", "eval_data_columns") if v["grain_eval_files"] else ("train_data_columns",)


# --------------------------------------------------------------------------------------------
# The rules of each objective (its row's `checks`); the shared ones below the table
# --------------------------------------------------------------------------------------------

GRPO_REWARDS = ("exact_match", "format")  # maxtrain/training/rewards.py: built-in rewards
GRPO_ENVIRONMENTS = ("calculator",)  # maxtrain/training/environments.py: built-in environments


def _grpo_settings(v):
    """GRPO's settings against one another (docs/post_training.md); the reward functions are imported at start."""
    _require(v["num_generations"] >= 2,
             f"num_generations={v['num_generations']}: GRPO's advantage is a completion's reward minus its group's "
             "mean, always 0 in a group of one; sample 2 or more completions per prompt (4 to 16 are usual)")
    _require(v["num_epoch"] == -1, f"objective=grpo repeats its prompts (num_epoch=-1), but num_epoch="
                                   f"{v['num_epoch']}; bound the run with steps instead")
    for name in v["grpo_reward_functions"]:
        module, _, function = str(name).partition(":")
        _require(name in GRPO_REWARDS or (module and function),
                 f"grpo_reward_functions: {name!r} is neither a built-in reward ({', '.join(GRPO_REWARDS)}) nor an "
                 "import path module:function (e.g. my_rewards:score, with my_rewards.py on PYTHONPATH)")
    _require(len(v["grpo_reward_functions"]) > 0 or bool(v["grpo_environment"]),
             "grpo_reward_functions is empty; name at least one, e.g. [exact_match] (or set grpo_environment, whose "
             "rewards are then the episode's)")


def _grpo_environment_settings(v):
    """The environment's name (training/episodes.py); grpo_max_turns without one: features.REQUIRES."""
    name = str(v["grpo_environment"])
    module, _, cls = name.partition(":")
    _require(not name or name in GRPO_ENVIRONMENTS or (module and cls),
             f"grpo_environment={name!r} is neither a built-in environment ({', '.join(GRPO_ENVIRONMENTS)}) nor an "
             "import path module:Class (e.g. my_envs:Maze, with my_envs.py on PYTHONPATH)")


GRPO_ROUTING_KEYS = ("grpo_routing_replay",)
# GRPO's rollout workers (training/rollout/): grpo_rollout_workers; the others do nothing without workers (features.py)
GRPO_WORKER_KEYS = ("grpo_rollout_workers", "grpo_rollout_engine", "grpo_off_policy_steps", "grpo_tis_cap",
                    "grpo_rollout_chunk_tokens", "grpo_rollout_worker_devices")


def _ray_installed() -> bool:
    import importlib.util  # pylint: disable=import-outside-toplevel
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None for it
        return False


def _ray_address_reachable(address: str) -> bool:
    """Whether RAY_ADDRESS's head (host:port, ray://host:port) accepts a connection; 'auto' and 'local' are
    Ray's own to resolve."""
    import socket  # pylint: disable=import-outside-toplevel
    if address in ("auto", "local"):
        return True
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=3):
            return True
    except (OSError, ValueError):
        return False


def grpo_corrects(config) -> bool:
    """Whether GRPO's update corrects for its rollout engine (truncated importance sampling, pi_old the trainer's own;
    training/rollout/correction.py): the tokens may come from older weights (grpo_off_policy_steps > 0) or another
    engine's kernels. The JAX engine on policy samples with the trainer's own program and weights: the colocated run."""
    return (config.objective == "grpo" and config.grpo_rollout_workers > 0
            and (config.grpo_off_policy_steps > 0 or config.grpo_rollout_engine != "jax"))


def _grpo_worker_settings(v):
    """Rollout workers: what the asynchronous path does not run yet (said first: it holds on any machine), then Ray
    installed, reachable, and the workers' CPUs."""
    import os  # pylint: disable=import-outside-toplevel
    workers = v["grpo_rollout_workers"]
    if workers == 0:
        return
    _require(not v["grpo_routing_replay"], "grpo_routing_replay=true does not run with rollout workers yet (the "
                                           "engines do not return the experts they chose); set grpo_rollout_workers=0")
    _require(not v["grpo_environment"], f"grpo_environment={v['grpo_environment']!r} plays its episodes in the trainer; "
                                        "the rollout workers sample single-turn completions only (yet); set "
                                        "grpo_rollout_workers=0, or grpo_environment=\"\"")
    per = v["grpo_steps_per_generation"] * v["grpo_num_iterations"]
    _require(v["grpo_off_policy_steps"] == 0 or per == 1,
             f"grpo_off_policy_steps={v['grpo_off_policy_steps']} overlaps each step's update with later rollouts, "
             f"but a rollout batch here trains {per} steps (grpo_steps_per_generation x grpo_num_iterations); set "
             "both to 1, or grpo_off_policy_steps=0")
    address = os.environ.get("RAY_ADDRESS", "")
    cpus = os.cpu_count() or 1
    _require(address or workers <= cpus, f"grpo_rollout_workers={workers} is more workers than this machine's {cpus} "
                                         f"CPUs (each worker holds one); set grpo_rollout_workers <= {cpus}, or join "
                                         "a Ray cluster with RAY_ADDRESS")
    _require(_ray_installed(), f"grpo_rollout_workers={workers} runs its workers on Ray, which is not installed; "
                               "pip install 'maxtrain[rl]' (or set grpo_rollout_workers=0 to sample in the trainer)")
    _require(not address or _ray_address_reachable(address),
             f"grpo_rollout_workers={workers}: RAY_ADDRESS={address} cannot be reached (nothing answers there); "
             "start the Ray head there (ray start --head), fix RAY_ADDRESS, or unset it for a local Ray")


# routing replay (models/moe/replay.py)
def _grpo_routing_settings(v):
    """Routing replay needs experts to replay, and runs without pipeline stages (the recorded experts are not yet
    split over stages)."""
    if not v["grpo_routing_replay"]:
        return
    _require(v["num_experts"] > 1, f"grpo_routing_replay=true replays the experts a mixture-of-experts model chose, "
                                   f"but num_experts={v['num_experts']} (a dense model); set grpo_routing_replay=false")
    stages = v["ici_pipeline_parallelism"] * v["dcn_pipeline_parallelism"]
    _require(stages == 1, f"grpo_routing_replay=true does not run in pipeline stages yet, but ici_pipeline_parallelism"
                          f" x dcn_pipeline_parallelism = {stages}; set both to 1 (or grpo_routing_replay=false)")
    _require(not v["grpo_environment"], f"grpo_routing_replay=true does not record the experts of multi-turn episodes "
                                        f"yet (grpo_environment={v['grpo_environment']!r}); set grpo_routing_replay=false "
                                        "or grpo_environment=\"\"")


# grpo_loss_type's keys (training/policy_losses.py): the rules TRL's GRPOConfig leaves to the user. (A key that does
# nothing under the chosen loss is features.REQUIRES': grpo_epsilon under cispo, grpo_kl_bias_correction without a KL.)
def _grpo_loss_settings(v):
    """CISPO's cap: TRL falls back to grpo_epsilon (0.2), which would cap every weight far below 1."""
    if v["grpo_loss_type"] != "cispo":
        return
    high = v["grpo_epsilon_high"]
    _require(high >= 1.0,
             "grpo_loss_type=cispo caps the importance weight pi / pi_old itself at grpo_epsilon_high, but "
             + ("grpo_epsilon_high is unset (-1, which would cap it at grpo_epsilon, below 1)" if high < 0 else
                f"grpo_epsilon_high={high:g} is below 1 (every on-policy token would be down-weighted)")
             + "; set grpo_epsilon_high to CISPO's eps_max, e.g. grpo_epsilon_high=5.0 (ScaleRL's)")


# GRPO's advantages, reward shaping and rollout batches (training/advantages.py, training/grpo.py): rl-adv's keys
GRPO_ROLLOUT_KEYS = ("grpo_advantage_estimator", "grpo_scale_rewards", "grpo_reward_std_ddof",
                     "grpo_mask_truncated_completions", "grpo_overlong_buffer_length", "grpo_overlong_penalty_factor",
                     "grpo_dynamic_sampling", "grpo_dynamic_sampling_max_batches", "grpo_num_iterations",
                     "grpo_steps_per_generation")


def _grpo_rollout_settings(v):
    """The rollout batch's steps against the checkpoints and the run's length; overlong shaping within the
    completion (its keys' second switches: features.REQUIRES)."""
    length = v["max_target_length"] - v["max_prefill_predict_length"]
    _require(v["grpo_overlong_buffer_length"] <= length,
             f"grpo_overlong_buffer_length={v['grpo_overlong_buffer_length']} is longer than a completion ("
             f"max_target_length - max_prefill_predict_length = {length} tokens); set it to at most {length} (DAPO: "
             "a quarter of the length or less)")
    per = v["grpo_steps_per_generation"] * v["grpo_num_iterations"]
    if per == 1:
        return
    how = (f"a rollout batch trains {per} steps (grpo_steps_per_generation={v['grpo_steps_per_generation']} x "
           f"grpo_num_iterations={v['grpo_num_iterations']}) and its completions are held in memory only")
    _require(v["steps"] % per == 0, f"steps={v['steps']} ends inside a rollout batch: {how}; set steps to a multiple "
                                    f"of {per} (e.g. steps={max(per, v['steps'] - v['steps'] % per)})")
    _require(not v["enable_checkpointing"] or v["checkpoint_period"] % per == 0,
             f"checkpoint_period={v['checkpoint_period']} would save inside a rollout batch: {how}; set "
             f"checkpoint_period to a multiple of {per} (e.g. checkpoint_period="
             f"{max(per, v['checkpoint_period'] - v['checkpoint_period'] % per)})")


def _distillation_settings(v):
    """Distillation needs its teacher (its checkpoint is read later: training/distillation.adopt_teacher)."""
    _require(bool(v["distill_teacher_path"]), f"objective={v['objective']} needs a teacher: set distill_teacher_path=<a "
                                              "checkpoint step dir or run dir> (scripts/convert_hf.py imports a "
                                              "Hugging Face model as one)")


def _on_policy_settings(v):
    """On-policy distillation (training/on_policy.py) samples its prompts over and over, as GRPO does."""
    _require(v["num_epoch"] == -1, f"objective=distill_on_policy repeats its prompts (num_epoch=-1), but num_epoch="
                                   f"{v['num_epoch']}; bound the run with steps instead")


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str                       # objective=<name>: TRL's trainer names (sft, dpo, grpo), lm, distill
    data: tuple[str, ...]           # the data kinds it reads (TEXT, ...); the first unless `data_key` picks another
    columns: dict                   # data kind -> the *_data_columns shapes it reads, with their usual names
    does: str                       # what it trains, for base.yml's readers and the summary
    frozen: str = ""                # the frozen model its state holds beside the params: "reference", "teacher"
    frozen_unless_zero: str = ""    # a key whose value 0 leaves the frozen model out (grpo_beta: no KL term)
    batch_keys: tuple[str, ...] = ()  # float32 batch entries it reads beyond the data's (made by its own step)
    samples: bool = False           # its batches are completions sampled from the policy as it trains
    next_token: bool = True         # its loss is next-token cross-entropy (multi-token prediction adds to it)
    pipeline: bool = True           # runs with pipeline stages
    processes: bool = True          # runs over several processes (GRPO: only with rollout workers, one_process_only)
    keys: tuple[str, ...] = ()      # the settings only it reads (refused under another objective: features.py)
    shown: tuple[str, ...] = ()     # those the start-up summary shows beside its name
    fix: str = ""                   # how to turn it on, where that is more than objective=<name>
    checks: tuple[Callable[[dict], None], ...] = ()  # its own rules on resolved values
    data_key: str = ""              # the key that picks among several data kinds
    old_key: str = ""               # the boolean it replaces (read with a notice; the use_* keys will be removed)

    def data_kind(self, v) -> str:
        return _get(v, self.data_key) if self.data_key else self.data[0]


ONE_TEXT_FIELD = (("text",),)
OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("lm", (TEXT,), {TEXT: ONE_TEXT_FIELD}, "next-token prediction on documents (pre-training)"),
    Objective("sft", (CONVERSATIONS,), {CONVERSATIONS: (("messages",), ("prompt", "completion"))},
              "supervised fine-tuning on conversations rendered with the chat template", old_key="use_sft"),
    Objective("dpo", (PAIRS,), {PAIRS: (("prompt", "chosen", "rejected"),)},
              "direct preference optimization against the frozen starting model", frozen="reference",
              next_token=False, keys=("dpo_beta", "dpo_label_smoothing"), shown=("dpo_beta", "dpo_label_smoothing"),
              old_key="use_dpo"),
    Objective("grpo", (PROMPTS,), {PROMPTS: (("prompt", "answer"),)},
              "reinforcement learning from verifiable rewards on completions sampled as it trains",
              frozen="reference", frozen_unless_zero="grpo_beta", batch_keys=("advantages", "old_log_probs"),
              samples=True, next_token=False, processes=False,
              keys=("num_generations", "grpo_beta", "grpo_epsilon", "grpo_reward_functions",
                    "max_prefill_predict_length",
                    "grpo_loss_type", "grpo_epsilon_high", "grpo_importance_sampling_level", "grpo_kl_bias_correction",
                    "grpo_environment", "grpo_max_turns")
                   + GRPO_ROLLOUT_KEYS + GRPO_ROUTING_KEYS + GRPO_WORKER_KEYS,
              shown=("num_generations", "grpo_beta", "grpo_epsilon", "grpo_loss_type"),
              checks=(_grpo_settings, _grpo_loss_settings, _grpo_rollout_settings, _grpo_routing_settings,
                      _grpo_environment_settings, _grpo_worker_settings),
              old_key="use_grpo"),
    Objective("distill", (TEXT, CONVERSATIONS), {TEXT: ONE_TEXT_FIELD,
                                                 CONVERSATIONS: (("messages",), ("prompt", "completion"))},
              "towards a frozen teacher's next-token distributions, mixed with next-token prediction",
              frozen="teacher", next_token=False, pipeline=False,
              keys=("distill_teacher_path", "distill_alpha", "distill_temperature", "distill_data"),
              shown=("distill_alpha", "distill_temperature"),
              fix="set objective=distill (with distill_teacher_path=<the teacher's checkpoint>)",
              checks=(_distillation_settings,), data_key="distill_data", old_key="use_distillation"),
    # On-policy distillation (Agarwal et al. 2024; TRL's DistillationTrainer at beta=1; Thinking Machines 2025): a row
    # of its own rather than a switch of distill's, because every field of the row differs from distill's: the data
    # kind (prompts, not text), sampling as it trains, the keys it reads (GRPO's prompt length and generations, not
    # distill_alpha / distill_data / distill_temperature: the loss's temperature is the sampler's, as in TRL), so
    # features.py refuses the keys that do nothing from the rows alone. training/on_policy.py is its step.
    Objective("distill_on_policy", (PROMPTS,), {PROMPTS: (("prompt", "answer"), ("prompt",))},
              "towards a frozen teacher on completions the student samples as it trains: reverse KL per token",
              frozen="teacher", samples=True, next_token=False, pipeline=False, processes=False,
              keys=("distill_teacher_path", "num_generations", "max_prefill_predict_length"),
              shown=("num_generations",),
              fix="set objective=distill_on_policy (with distill_teacher_path=<the teacher's checkpoint>)",
              checks=(_distillation_settings, _on_policy_settings)),
)}
NAMES = tuple(OBJECTIVES)  # base.yml's `{$objectives}`
OLD_KEYS = {o.old_key: o.name for o in OBJECTIVES.values() if o.old_key}


def of(v) -> Objective:
    """The configured objective's row (config values or a Config)."""
    return OBJECTIVES[_get(v, "objective")]


def data_kind(v) -> str:
    """What the run reads: TEXT, CONVERSATIONS, PAIRS or PROMPTS."""
    return of(v).data_kind(v)


def rewarded(v) -> bool:
    """Whether the run's sampled completions are scored by reward functions (GRPO), not by a teacher."""
    return of(v).samples and "grpo_reward_functions" in of(v).keys


def holds_frozen(v) -> bool:
    """Whether the run's state holds its objective's frozen model (a reference or a teacher)."""
    row = of(v)
    return bool(row.frozen) and not (row.frozen_unless_zero and _get(v, row.frozen_unless_zero) == 0)


def templated(v) -> bool:
    """Whether the run's records are rendered with a chat template (every data kind but text)."""
    return data_kind(v) != TEXT


# --------------------------------------------------------------------------------------------
# The rules every objective shares: the data settings fit its data kind
# --------------------------------------------------------------------------------------------

def _shape(columns) -> str:
    return "[" + ",".join(columns) + "]"


def _data_fits_the_objective(v):
    """The *_data_columns and dataset_type against the data kind (docs/post_training.md)."""
    row, kind = of(v), data_kind(v)
    shapes = row.columns[kind]
    for key in _columns_keys(v):
        columns = v[key]
        _require(all(isinstance(c, str) and c for c in columns),
                 f"{key}={columns!r} must be a list of field names, e.g. {key}={_shape(shapes[0])}")
        if kind == TEXT:
            _require(len(columns) == 1, f"{key}={columns!r} must name exactly one text field, e.g. {key}=[text]")
            continue
        what = "prompts and their answers" if kind == PROMPTS else kind
        _require(len(columns) in {len(s) for s in shapes},
                 f"{running(v)} reads {what}, but {key}={columns!r}; set {key}={_shape(shapes[0])} (the names of your "
                 "fields, in that order)" + "".join(f", or {_shape(s)}" for s in shapes[1:]))
    if kind != TEXT:
        _require(v["dataset_type"] in RECORD_FILES,
                 f"{running(v)} reads jsonl or parquet files, but dataset_type={v['dataset_type']}; set "
                 f"dataset_type=jsonl (or parquet) and grain_train_files=<your files>")


def running(v) -> str:
    """The objective as a message names it: objective=sft, objective=distill with distill_data=conversations."""
    row = of(v)
    more = f" with {row.data_key}={_get(v, row.data_key)}" if row.data_key and data_kind(v) != row.data[0] else ""
    return f"objective={row.name}{more}"


def _the_row_s_own_rules(v):
    for check in of(v).checks:
        check(v)


def one_process_only(v, processes: int, said: str = "") -> None:
    """An objective that runs in one process (its row's `processes`), with `processes` > 1: refused. The config's
    num_processes here (every process has the same); train.py asks again with the processes the environment
    names (parallel/distributed.settings), before joining them. `said`: where the count comes from, if not the
    config. GRPO with rollout workers runs over several (training/rollout/multihost.py), less what it cannot yet."""
    if processes <= 1 or of(v).processes:
        return
    said = said or f"num_processes={processes}"
    if of(v).name == "grpo":
        _require(_get(v, "grpo_rollout_workers") > 0,
                 f"objective=grpo samples in the trainer's one process (grpo_rollout_workers=0), but {said}; set "
                 "grpo_rollout_workers >= 1 (Ray rollout workers: the trainer then runs over several processes), or "
                 "run it without a coordinator, on one machine's devices")
        _require(not _get(v, "grpo_dynamic_sampling"),
                 f"grpo_dynamic_sampling=true decides its further prompt draws on one host, but {said}; set "
                 "grpo_dynamic_sampling=false, or run it without a coordinator, on one machine's devices")
        return
    _require(False, f"{running(v)} runs in one process for now (its rollouts are gathered on one host), but "
                    f"{said}; run it without a coordinator, on one machine's devices")


CHECKS = (_data_fits_the_objective, _the_row_s_own_rules, lambda v: one_process_only(v, v["num_processes"]))


# --------------------------------------------------------------------------------------------
# The old switches (config/loading.py) and saved configs that have them (checkpoints)
# --------------------------------------------------------------------------------------------

CHAT_DISTILLATION = ("use_sft", "use_distillation")  # both true: distillation on conversations


def from_old_keys(old: dict[str, bool], objective: str | None) -> tuple[dict[str, Any], str]:
    """(the settings that the use_* booleans `old` (in the order given) stand for, the one line of notice).

    `objective` is the objective key's value where the user set it (None: not set). Two true, or one
    contradicting `objective`, is a ConfigError naming both keys."""
    true = [k for k, on in old.items() if on]
    changes: dict[str, Any] = {}
    if sorted(true) == sorted(CHAT_DISTILLATION):  # distilling on SFT's data was the pair of them
        changes = {"objective": "distill", "distill_data": CONVERSATIONS}
    elif len(true) > 1:
        first, second = true[:2]
        raise ConfigError(f"{first}=true and {second}=true were both set; a run has one objective: set objective="
                          f"{OLD_KEYS[first]} or objective={OLD_KEYS[second]} (the use_* keys will be removed). Run "
                          "one first, then the other from its checkpoint with load_parameters_path=<that run>")
    elif true:
        changes = {"objective": OLD_KEYS[true[0]]}
    if objective is not None and changes and changes["objective"] != objective:
        raise ConfigError(f"{' and '.join(k + '=true' for k in true)} contradicts objective={objective}: a run has one "
                          f"objective; drop {' and '.join(true)} (the use_* keys will be removed)")
    for key, on in old.items():
        if not on and OLD_KEYS[key] == changes.get("objective", objective):
            raise ConfigError(f"{key}=false contradicts objective={OLD_KEYS[key]}; drop {key} (the use_* keys will be "
                              "removed)")
    given = " ".join(f"{k}={str(on).lower()}" for k, on in old.items())
    now = " ".join(f"{k}={value}" for k, value in changes.items()) or f"objective={objective or 'lm'}"
    verb = "are" if len(old) > 1 else "is"
    return changes, f"maxtrain: {given} {verb} now {now} (the use_* keys will be removed)"


def saved_objective(saved: dict) -> dict[str, Any]:
    """A checkpoint's saved config with its objective as `objective` (and distill_data): its use_* booleans,
    where it was written before the objective key, read as from_old_keys reads them."""
    old = {k: bool(saved[k]) for k in OLD_KEYS if k in saved}
    rest = {k: value for k, value in saved.items() if k not in OLD_KEYS}
    if "objective" in saved or not old:
        return rest
    try:
        changes, _ = from_old_keys(old, None)
    except ConfigError:
        return rest  # a config no run could have been started with: nothing to say about its objective
    return {**rest, "objective": "lm", **changes}
