"""The bad-input rows of python -m maxtrain.train: what a user can give it wrong, and what it must answer."""

from __future__ import annotations

from bad_inputs.world import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import

# an on-policy distillation run's settings (its data files are never read: every row stops at the config)
OPD = ["distill_teacher_path={run}", "objective=distill_on_policy", "dataset_type=jsonl", "grain_train_files=x.jsonl",
       "train_data_columns=[prompt]", "decode_sampling_strategy=weighted"]
GRPO = ["objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl", "train_data_columns=[prompt,answer]",
        "decode_sampling_strategy=weighted", "max_prefill_predict_length=16"]  # a GRPO run's settings up to its data (the rows stop before reading it)

ROWS = [
    # train: config keys and values
    Row("unknown-key", T, [B, "base_emb_dimm=64"], r"unknown config key 'base_emb_dimm': did you mean base_emb_dim\?"),
    Row("wrong-type-int", T, [B, "steps=abc"], r"steps='abc' has the wrong type; steps must be an integer"),
    Row("wrong-type-float", T, [B, "gradient_accumulation_steps=0.5"], r"gradient_accumulation_steps=0.5 has the wrong type"),
    Row("wrong-type-bool", T, [B, "scan_layers=maybe"], r"scan_layers='maybe' has the wrong type"),
    Row("steps-zero", T, [B, "steps=0"], r"steps=0 is not allowed: it must be >= 1"),
    Row("lr-nan", T, [B, "learning_rate=nan"], r"learning_rate=nan is not allowed: it must be >= 0"),
    Row("lr-inf", T, [B, "learning_rate=inf"], r"learning_rate=inf is not allowed"),
    Row("adam-eps-negative", T, [B, "adam_eps=-1"], r"adam_eps=-1.0 is not allowed: it must be > 0"),
    Row("adam-b2-one", T, [B, "adam_b2=1"], r"adam_b2=1.0 is not allowed: it must be in \[0, 1\)"),
    Row("schedule-steps-negative", T, [B, "learning_rate_schedule_steps=-5"],
        r"learning_rate_schedule_steps=-5 is not allowed: it must be -1 or >= 1"),
    Row("weight-decay-negative", T, [B, "adam_weight_decay=-5"], r"adam_weight_decay=-5.0 is not allowed"),
    Row("grain-workers-negative", T, [B, "grain_worker_count=-2"], r"grain_worker_count=-2 is not allowed"),
    Row("peak-tflops-negative", T, [B, "peak_tflops_per_device=-3"], r"peak_tflops_per_device=-3.0 is not allowed"),
    Row("warmup-fraction-above-1", T, [B, "warmup_steps_fraction=1.5"], r"warmup_steps_fraction=1.5 is not allowed"),
    Row("seed-negative", T, [B, "seed=-1"], r"seed=-1 is not allowed: it must be in \[0, 4294967295\]"),
    Row("dtype-unknown", T, [B, "dtype=fp8"], r"dtype='fp8' is not allowed: it must be one of: autoselected"),
    Row("schedule-unknown", T, [B, "lr_schedule_type=linear"], r"lr_schedule_type='linear' is not allowed"),
    Row("flash-block-not-power-of-two", T, [B, "sa_block_q=100"], r"sa_block_q=100 must be a power of two"),
    Row("kv-heads-do-not-divide", T, [B, "base_num_kv_heads=3"], r"base_num_query_heads=4 must be a multiple of "
        r"base_num_kv_heads=3"),
    Row("tensor-parallelism-does-not-divide", T, [B, "ici_tensor_parallelism=3"], r"tensor parallelism 3 .* must "
        r"divide base_num_query_heads=4"),
    Row("two-fill-axes", T, [B, "ici_data_parallelism=-1"], r"only one ici_\*_parallelism may be -1"),
    Row("mesh-axis-unknown", T, [B, 'logical_axis_rules=[["embed", "model"]]'], r"unknown mesh axis 'model'"),
    Row("two-text-columns", T, [B, "train_data_columns=[a, b]"], r"train_data_columns=\['a', 'b'\] must name "
        r"exactly one text field"),
    Row("model-preset-missing", T, [B, "model_name=gpt5"], r"model_name='gpt5' (has no preset|is not a preset)"),
    Row("both-starting-points", T, [B, "load_parameters_path=a", "load_full_state_path=b"],
        r"set only one of load_parameters_path .* and load_full_state_path"),
    Row("moe-experts-per-token-above-experts", T, [B, "decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=6"],
        r"num_experts_per_tok=6 is more than num_experts=4: .* use num_experts_per_tok <= 4"),
    Row("moe-expert-parallelism-does-not-divide", T, [B, "decoder_block=mixtral", "num_experts=4",
                                                      "num_experts_per_tok=2", "ici_expert_parallelism=3"],
        r"expert parallelism 3 .* must divide num_experts=4: .* e.g. ici_expert_parallelism=(2|4)"),
    Row("moe-capacity-factor-zero", T, [B, "decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2",
                                        "moe_dispatch=capacity", "capacity_factor=0"],
        r"capacity_factor=0.0 is not allowed: it must be > 0 .*moe_dispatch=dropless"),
    Row("moe-grouped-matmul-unknown", T, [B, "decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2",
                                          "moe_grouped_matmul=triton"],
        r"moe_grouped_matmul='triton' is not allowed: it must be one of: autoselected, xla, pallas"),
    Row("gdn-kernel-chunk-not-a-tile", T, [B, "decoder_block=qwen3_5_text", "inhomogeneous_layer_cycle_interval=2",
                                           "gdn_kernel=pallas", "gdn_chunk_size=24"],
        r"gdn_chunk_size=24 cannot run in the gated delta-net Pallas kernel: .* set gdn_chunk_size=16 or gdn_kernel=jnp",
        tiny=True),
    Row("fp8-with-float16", T, [B, "quantization=fp8", "dtype=float16"],
        r"quantization=fp8 with dtype=float16 is not supported: .* use dtype=bfloat16"),
    Row("fp8-unknown-recipe", T, [B, "quantization=int8"], r"quantization='int8' is not supported; use quantization=fp8"),
    Row("fp8-head-without-quantization", T, [B, "quantize_output_head=true"],
        r"quantize_output_head=true only applies with quantization=fp8 or fp8_mlp"),
    Row("key-twice-on-command-line", T, [B, "steps=3", "steps=5"], r"the command line sets steps twice \(argument 2: "
        r"'steps=3' and argument 3: 'steps=5'\)"),
    Row("override-without-equals", T, [B, "steps"], r"cannot read argument 'steps': overrides are key=value"),
    Row("first-argument-not-yaml", T, ["steps=3"], r"the first argument must be a YAML config file"),
    Row("no-arguments", T, [], r"usage: python -m maxtrain.train configs/base.yml"),
    Row("eval-split-zero-default-corpus", T, [B, "eval_split_fraction=0"], r"eval_split_fraction=0.0 must be "
        r"strictly between 0 and 1"),
    # train: nothing silent (issue 44): a setting of a feature that is off, a family's defining setting left off,
    # a sampler with one choice, a sequence too short for a setting, an empty output directory
    Row("feature-off-distillation-key", T, [B, "distill_alpha=0.3"], r"distill_alpha=0.3 does nothing without "
        r"objective=distill \(here objective=lm\): set objective=distill .*, or drop distill_alpha"),
    Row("feature-off-muon-key", T, [B, "muon_beta=0.9"], r"muon_beta=0.9 does nothing without opt_type=muon"),
    Row("feature-off-moe-key-on-dense", T, [B, "num_experts_per_tok=2"], r"num_experts_per_tok=2 does nothing without "
        r"a mixture-of-experts family \(here decoder_block=llama\)"),
    Row("feature-off-window-on-llama", T, [B, "sliding_window_size=4096"], r"sliding_window_size=4096 does nothing "
        r"without sliding-window layers"),
    Row("family-gpt-oss-without-window", T, [B, "model_name=gpt-oss-20b", "sliding_window_size=0"],
        r"decoder_block=gpt_oss has sliding-window layers .* set sliding_window_size=128"),
    Row("family-olmo3-without-window", T, [B, "model_name=olmo3-7b", "sliding_window_size=0"],
        r"decoder_block=olmo3 has sliding-window layers \(sliding sliding sliding full, repeated\), but "
        r"sliding_window_size=0 .* set sliding_window_size=4096"),
    Row("family-moe-with-one-expert", T, [B, "decoder_block=mixtral"], r"decoder_block=mixtral is a mixture of experts, "
        r"but num_experts=1 .* set num_experts=8"),
    # Gemma 4 (gemma4_text): layers of their own head shape, shared keys and values
    Row("gemma4-shared-kv-without-producer", T, [*G4, "attention_layer_types=[sliding,sliding,sliding,full]",
                                                 "num_kv_shared_layers=1"],
        r"num_kv_shared_layers=1: each of the last 1 layers shares the keys and values of an earlier layer .* "
        r"leave none for \['full'\]"),
    Row("gemma4-shared-kv-all-layers", T, [*G4, "num_kv_shared_layers=4"], r"num_kv_shared_layers=4: .* use fewer"),
    Row("gemma4-global-head-dim-odd", T, [*G4, "global_head_dim=33"], r"global_head_dim=33 must be even"),
    Row("gemma4-global-kv-heads-not-dividing", T, [*G4, "global_num_kv_heads=3"],
        r"base_num_query_heads=4 must be a multiple of global_num_kv_heads=3"),
    Row("gemma4-cudnn-wide-heads", T, [*G4, "global_head_dim=512", "attention=cudnn"],
        r"attention=cudnn takes heads of at most 256 features, but global_head_dim=512"),
    Row("gemma4-double-wide-without-shared", T, [*G4, "double_wide_mlp=true"],
        r"double_wide_mlp=true widens the shared-KV layers' MLP, but num_kv_shared_layers=0"),
    Row("gemma4-key-on-another-family", T, [B, "global_head_dim=128"],
        r"global_head_dim=128 does nothing without decoder_block=gemma4_text"),
    Row("rope-proportion-without-proportional", T, [B, "rope_proportion=0.5"],
        r"rope_proportion=0.5 does nothing without rope_type=proportional"),
    Row("grpo-top-k-of-one", T, [B, "objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                 "train_data_columns=[prompt,answer]", "eval_data_columns=[prompt,answer]",
                                 "decode_sampling_strategy=topk", "decode_sampling_top_k=1"],
        r"objective=grpo samples .*decode_sampling_top_k=1.* would all be the same"),
    # GRPO routing replay (models/moe/replay.py): experts to replay, under objective=grpo
    Row("grpo-routing-replay-on-a-dense-model", T, [B, "objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                                    "train_data_columns=[prompt,answer]", "decode_sampling_strategy=weighted",
                                                    "grpo_routing_replay=true"],
        r"grpo_routing_replay=true replays the experts a mixture-of-experts model chose, but num_experts=1"),
    Row("grpo-routing-replay-without-grpo", T, [B, "decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2",
                                                "grpo_routing_replay=true"],
        r"grpo_routing_replay=true does nothing without objective=grpo"),
    # GRPO's loss variants (training/policy_losses.py): an unknown loss, keys that do nothing under the chosen loss
    Row("grpo-loss-type-unknown", T, [B, *GRPO, "grpo_loss_type=ppo"],
        r"grpo_loss_type='ppo' is not allowed: it must be .*grpo.*bnpo.*dr_grpo.*dapo.*cispo"),
    Row("grpo-epsilon-with-cispo", T, [B, *GRPO, "grpo_loss_type=cispo", "grpo_epsilon_high=5", "grpo_epsilon=0.3"],
        r"grpo_epsilon=0.3 does nothing without a clipped loss .*here grpo_loss_type=cispo.*grpo_epsilon_high"),
    Row("grpo-kl-bias-correction-without-kl", T, [B, *GRPO, "grpo_beta=0", "grpo_kl_bias_correction=true"],
        r"grpo_kl_bias_correction=true does nothing without a KL term \(grpo_beta > 0\).*set grpo_beta > 0"),
    Row("grpo-cispo-without-its-cap", T, [B, *GRPO, "grpo_loss_type=cispo"],
        r"grpo_loss_type=cispo caps .* grpo_epsilon_high is unset .*set grpo_epsilon_high to CISPO's eps_max"),
    Row("grpo-cispo-cap-below-one", T, [B, *GRPO, "grpo_loss_type=cispo", "grpo_epsilon_high=0.28"],
        r"grpo_epsilon_high=0.28 is below 1 .*e.g. grpo_epsilon_high=5.0"),
    # GRPO's rollout workers (training/rollout/): their keys without workers, more workers than CPUs
    Row("grpo-off-policy-without-workers", T, [B, *GRPO, "grpo_off_policy_steps=1"],
        r"grpo_off_policy_steps=1 does nothing without rollout workers \(grpo_rollout_workers > 0\).*pip install"),
    Row("grpo-tis-cap-without-workers", T, [B, *GRPO, "grpo_tis_cap=2"],
        r"grpo_tis_cap=2.0 does nothing without rollout workers"),
    Row("grpo-rollout-engine-without-workers", T, [B, *GRPO, "grpo_rollout_engine=vllm"],
        r"grpo_rollout_engine='?vllm'? does nothing without rollout workers"),
    Row("grpo-more-workers-than-cpus", T, [B, *GRPO, "grpo_rollout_workers=4096"],
        r"grpo_rollout_workers=4096 is more workers than this machine's \d+ CPUs"),
    Row("grpo-workers-off-policy-with-mini-batches", T, [B, *GRPO, "grpo_rollout_workers=1", "grpo_off_policy_steps=1",
                                                         "grpo_steps_per_generation=2", "steps=2"],
        r"grpo_off_policy_steps=1 overlaps .* trains 2 steps"),
    Row("grpo-loss-type-under-lm", T, [B, "grpo_loss_type=cispo"],
        r"grpo_loss_type='?cispo'? does nothing without objective=grpo"),
    # GRPO's advantages, reward shaping and rollout batches (rl-adv): a key that does nothing, a rollout batch that
    # checkpoints or ends inside itself
    Row("grpo-std-ddof-without-scaling", T, [B, *GRPO, "grpo_scale_rewards=none", "grpo_reward_std_ddof=1"],
        r"grpo_reward_std_ddof=1 does nothing without grpo_scale_rewards=group or batch \(here grpo_scale_rewards="
        r"none\): set grpo_scale_rewards=group"),
    Row("grpo-overlong-factor-without-buffer", T, [B, *GRPO, "grpo_overlong_penalty_factor=0.5"],
        r"grpo_overlong_penalty_factor=0.5 does nothing without grpo_overlong_buffer_length > 0"),
    Row("grpo-overlong-buffer-beyond-completion", T, [B, *GRPO, "grpo_overlong_buffer_length=5000"],
        r"grpo_overlong_buffer_length=5000 is longer than a completion \(max_target_length - "
        r"max_prefill_predict_length = \d+ tokens\)"),
    Row("grpo-dynamic-budget-without-dynamic-sampling", T, [B, *GRPO, "grpo_dynamic_sampling_max_batches=4"],
        r"grpo_dynamic_sampling_max_batches=4 does nothing without grpo_dynamic_sampling=true"),
    Row("grpo-iterations-under-lm", T, [B, "grpo_num_iterations=2"],
        r"grpo_num_iterations=2 does nothing without objective=grpo"),
    Row("grpo-rollout-batch-across-checkpoints", T, [B, *GRPO, "grpo_num_iterations=2", "steps=4",
                                                     "checkpoint_period=3"],
        r"checkpoint_period=3 would save inside a rollout batch: a rollout batch trains 2 steps .*; set "
        r"checkpoint_period to a multiple of 2"),
    Row("grpo-rollout-batch-past-the-last-step", T, [B, *GRPO, "grpo_steps_per_generation=2", "steps=5"],
        r"steps=5 ends inside a rollout batch: .*; set steps to a multiple of 2 \(e.g. steps=4\)"),
    Row("mtp-modules-beyond-the-sequence", T, [B, "model_name=deepseek3-tiny", "mtp_num_layers=4", "max_target_length=4"],
        r"mtp_num_layers=4 needs max_target_length >= 5, but max_target_length=4"),
    # (a chunk of Llama 4's chunked attention at least as long as the sequence is full attention: accepted, as Llama 4
    # Scout's 8,192 at 4,096 tokens; tests/config/test_config.py)
    Row("hybrid-gdn-chunk-longer-than-the-sequence", T, [B, "model_name=qwen3-next-80b-a3b", "gdn_chunk_size=128",
                                                         "max_target_length=64"],
        r"gdn_chunk_size=128 needs max_target_length >= 128, but max_target_length=64: the gated delta rule pads the "
        r"sequence to whole chunks"),
    # the off-feature gate's second switches: a key of an active family that needs another of its switches
    Row("feature-off-temperature-scale-without-tuning", T, [B, "decoder_block=llama4_text", "num_experts=4",
                                                            "nope_layer_interval=4", "temperature_tuning_scale=0.2"],
        r"temperature_tuning_scale=0.2 does nothing without temperature_tuning=true \(here temperature_tuning=false\)"),
    Row("feature-off-chunk-without-rope-layers", T, [B, "decoder_block=llama4_text", "num_experts=4",
                                                     "nope_layer_interval=1", "chunk_attn_window_size=64"],
        r"chunk_attn_window_size=64 does nothing without RoPE layers \(nope_layer_interval other than 1\) \(here "
        r"nope_layer_interval=1\)"),
    Row("feature-off-gdn-without-linear-layers", T, [B, "model_name=qwen3-next-80b-a3b",
                                                     "inhomogeneous_layer_cycle_interval=1", "gdn_chunk_size=32"],
        r"gdn_chunk_size=32 does nothing without gated delta-net layers \(inhomogeneous_layer_cycle_interval >= 2\)"),
    Row("feature-off-grouped-matmul-with-capacity", T, [B, "decoder_block=mixtral", "num_experts=4",
                                                        "moe_dispatch=capacity", "moe_grouped_matmul=pallas"],
        r"moe_grouped_matmul='pallas' does nothing without moe_dispatch=dropless \(here moe_dispatch=capacity\)"),
    Row("feature-off-key-of-a-user-preset", T, [B, "model_name={scratch}/my.yml"],
        r"model_name=.*/my.yml: temperature_tuning_scale=0.2 does nothing without temperature_tuning=true",
        setup=yaml_file("decoder_block: llama4_text\nnum_experts: 4\nnope_layer_interval: 4\n"
                        "temperature_tuning_scale: 0.2\n")),
    # rules that place experts leaving none
    Row("moe-sparse-step-leaves-no-experts", T, [B, "decoder_block=qwen3_moe", "num_experts=4",
                                                 "decoder_sparse_step=8"],
        r"decoder_sparse_step=8 leaves no layer of experts among base_num_decoder_layers=4: decoder_block=qwen3_moe "
        r"would be a dense model"),
    Row("moe-mlp-only-layers-leave-no-experts", T, [B, "decoder_block=qwen3_moe", "num_experts=4",
                                                    "mlp_only_layers=[0,1,2,3]"],
        r"mlp_only_layers=\[0, 1, 2, 3\] leaves no layer of experts"),
    # keys of another command
    Row("train-with-compile-topology", T, [B, "compile_topology=v5p-8"],
        r"compile_topology='v5p-8' is read by maxtrain.train_compile, not by maxtrain.train"),
    Row("train-with-compile-report-file", T, [B, "compile_report_file={scratch}/r.json"],
        r"compile_report_file='.*/r.json' is read by maxtrain.train_compile, not by maxtrain.train"),
    Row("llama4-nope-interval-zero", T, [B, "decoder_block=llama4_text", "num_experts=4", "nope_layer_interval=0"],
        r"nope_layer_interval=0 is not allowed: it must be -1 or >= 1"),
    # context parallelism's strategies (issue 60)
    Row("cp-strategy-without-context-parallelism", T, [B, "context_parallel_strategy=ring"],
        r"context_parallel_strategy='ring' does nothing without context parallelism: set ici_context_parallelism "
        r"\(or dcn_context_parallelism\) > 1, or drop context_parallel_strategy"),
    Row("cp-reorder-without-context-parallelism", T, [B, "context_parallel_reorder_strategy=striped"],
        r"context_parallel_reorder_strategy='striped' does nothing without context parallelism: set "
        r"ici_context_parallelism"),
    Row("cp-strategy-unknown", T, [B, "ici_context_parallelism=2", "context_parallel_strategy=hybrid"],
        r"context_parallel_strategy='hybrid' is not allowed: it must be one of: all_gather, ring, ulysses, usp"),
    Row("cp-ulysses-heads-do-not-divide", T, [B, "ici_context_parallelism=4", "base_num_kv_heads=2",
                                              "context_parallel_strategy=ulysses"],
        r"context_parallel_strategy=ulysses splits the heads over the context group, but base_num_kv_heads=2 is not a "
        r"multiple of context parallelism 4; use context_parallel_strategy=ring \(or all_gather\)"),
    Row("cp-ring-with-pipeline-stages", T, [B, "ici_context_parallelism=2", "ici_pipeline_parallelism=2",
                                            "context_parallel_strategy=ring"],
        r"context_parallel_strategy=ring does not run with pipeline parallelism yet; set "
        r"context_parallel_strategy=all_gather, or ici_pipeline_parallelism=1"),
    Row("cp-kernel-with-all-gather", T, [B, "ici_context_parallelism=2", "attention=cudnn"],
        r"attention=cudnn does not run with context_parallel_strategy=all_gather \(2 ways\): its attention is the "
        r"plain-jnp form. Use attention=dot_product \(or autoselected\), or context_parallel_strategy=ring or "
        r"ulysses or usp\."),
    Row("cp-all-gather-flash-with-pipeline-stages", T, [B, "ici_context_parallelism=2", "ici_pipeline_parallelism=2",
                                                        "attention=flash"],
        r"attention=flash with context_parallelism \(all_gather\) does not run with pipeline parallelism yet; set "
        r"attention=dot_product or autoselected"),
    # attention kernels inside the ring (issue 60, ring_flash.py)
    Row("cp-ring-flash-striped-runs-under-a-block", T, [B, "ici_context_parallelism=2", "context_parallel_strategy=ring",
                                                        "context_parallel_reorder_strategy=striped", "attention=flash",
                                                        "max_target_length=48"],
        r"attention=flash with context_parallel_strategy=ring cuts each sequence into 2 runs of a multiple of 16 "
        r"tokens .*, so max_target_length=48 must be a multiple of 32; e.g. max_target_length=32"),
    Row("cp-ring-flash-chunks-under-a-block", T, [B, "ici_context_parallelism=2", "context_parallel_strategy=ring",
                                                  "attention=flash", "max_target_length=36"],
        r"attention=flash with context_parallel_strategy=ring cuts each sequence into 4 runs of a multiple of 16 "
        r"tokens .*, so max_target_length=36 must be a multiple of 64; e.g. max_target_length=64"),
    Row("cp-ring-tokamax", T, [B, "ici_context_parallelism=2", "context_parallel_strategy=ring", "attention=tokamax"],
        r"attention=tokamax does not run inside context_parallel_strategy=ring .*; use attention=flash"),
    Row("cp-ring-cudnn-chunks-under-a-block", T, [B, "ici_context_parallelism=2", "context_parallel_strategy=ring",
                                                  "attention=cudnn", "max_target_length=36"],
        r"attention=cudnn with context_parallel_strategy=ring cuts each sequence into 4 runs of a multiple of 16 "
        r"tokens .*, so max_target_length=36 must be a multiple of 64; e.g. max_target_length=64"),
    Row("cp-striped-length-does-not-divide", T, [B, "ici_context_parallelism=4", "max_target_length=34",
                                                 "context_parallel_reorder_strategy=striped"],
        r"context_parallel_reorder_strategy=striped deals each sequence's tokens round-robin to 4 devices, so "
        r"max_target_length=34 must be a multiple of 4; e.g. max_target_length=32"),
    # usp: ulysses over the ici context devices of a slice, the ring over the dcn ones (issue 60)
    Row("cp-usp-one-context-level", T, [B, "ici_context_parallelism=2", "context_parallel_strategy=usp"],
        r"context_parallel_strategy=usp runs ulysses over ici_context_parallelism and the ring over "
        r"dcn_context_parallelism, so both must be set > 1, but they are 2 and 1; with one context level use "
        r"context_parallel_strategy=ring or ulysses"),
    Row("cp-usp-heads-do-not-divide", T, [B, "ici_context_parallelism=4", "dcn_context_parallelism=2",
                                          "base_num_kv_heads=2", "context_parallel_strategy=usp"],
        r"context_parallel_strategy=usp splits the heads over the ici context devices of a slice, but "
        r"base_num_kv_heads=2 is not a multiple of ici_context_parallelism=4; use context_parallel_strategy=ring"),
    # the gated delta-net under context parallelism (issue 60)
    Row("cp-gdn-striped", T, [B, "model_name=qwen3-next-80b-a3b", "gdn_chunk_size=8", "ici_context_parallelism=2",
                              "context_parallel_reorder_strategy=striped"],
        r"context_parallel_reorder_strategy=striped deals the tokens round-robin, but decoder_block=qwen3_next's gated "
        r"delta-net layers run their recurrence over runs of consecutive tokens; set "
        r"context_parallel_reorder_strategy=dual_chunk_swap"),
    Row("cp-gdn-chunks-shorter-than-a-rule-chunk", T, [B, "model_name=qwen3-next-80b-a3b", "gdn_chunk_size=16",
                                                       "ici_context_parallelism=2", "max_target_length=32"],
        r"context parallelism 2 cuts max_target_length=32 into 4 chunks of 8 tokens, but the gated delta-net needs "
        r"chunks of at least 16 \(gdn_chunk_size"),
    # DeepSeek Sparse Attention under context parallelism: all_gather alone (issues 58, 60)
    Row("cp-sparse-attention-ring", T, [B, "model_name=deepseek3.2-tiny", "max_target_length=128",
                                        "ici_context_parallelism=2", "context_parallel_strategy=ring"],
        r"context_parallel_strategy=ring cannot split DeepSeek Sparse Attention over context parallelism 2: each "
        r"query's top-k keys may lie anywhere before it, .* set context_parallel_strategy=all_gather \(it gathers "
        r"MLA's latent, 80 numbers a token, and the indexer's keys\)"),
    Row("cp-sparse-attention-usp", T, [B, "model_name=deepseek3.2-tiny", "max_target_length=128", "num_slices=2",
                                       "ici_context_parallelism=2", "dcn_context_parallelism=2",
                                       "context_parallel_strategy=usp"],
        r"context_parallel_strategy=usp cannot split DeepSeek Sparse Attention over context parallelism 4: .* set "
        r"context_parallel_strategy=all_gather"),
    # DeepSeek-V4 under context parallelism: all_gather alone (issues 58, 60)
    # DeepSeek-V4 attends in its own form: a kernel named for it would do nothing (issue 58)
    Row("deepseek-v4-attention-kernel", T, [B, "model_name=deepseek4-tiny", "attention=flash"],
        r"attention=flash does nothing with decoder_block=deepseek_v4: its layers attend in their own plain-jnp form "
        r".* set attention=autoselected \(or dot_product\)"),
    Row("cp-deepseek-v4-ring", T, [B, "model_name=deepseek4-tiny", "ici_context_parallelism=2",
                                   "context_parallel_strategy=ring"],
        r"context_parallel_strategy=ring cannot split DeepSeek-V4's attention over context parallelism 2: its "
        r"compressors pool whole windows .* set context_parallel_strategy=all_gather \(it gathers each layer's input, "
        r"hidden_size=128 numbers a token\)"),
    Row("cp-deepseek-v4-ulysses", T, [B, "model_name=deepseek4-tiny", "ici_context_parallelism=2",
                                      "context_parallel_strategy=ulysses"],
        r"context_parallel_strategy=ulysses cannot split DeepSeek-V4's attention over context parallelism 2: .* set "
        r"context_parallel_strategy=all_gather"),
    # context parallelism: the other strategy that cannot run in pipeline stages, and dual_chunk_swap's 2C chunks
    Row("cp-ulysses-with-pipeline-stages", T, [B, "ici_context_parallelism=2", "ici_pipeline_parallelism=2",
                                               "context_parallel_strategy=ulysses"],
        r"context_parallel_strategy=ulysses does not run with pipeline parallelism yet; set "
        r"context_parallel_strategy=all_gather, or ici_pipeline_parallelism=1"),
    Row("cp-dual-chunk-swap-length-does-not-divide", T, [B, "ici_context_parallelism=4", "max_target_length=36"],
        r"context parallelism 4 \(ici_context_parallelism x dcn_context_parallelism\) splits each sequence into 8 "
        r"chunks .* max_target_length=36 must be a multiple of 8; e.g. max_target_length=32"),
    Row("feature-off-llama4-key-on-llama", T, [B, "use_qk_norm=true"], r"use_qk_norm=true does nothing without "
        r"decoder_block=llama4_text"),
    Row("glm4_moe-rotated-features-odd", T, [B, "model_name=glm-4.5-air", "partial_rotary_factor=0.01"],
        r"partial_rotary_factor=0.01 rotates 1 of head_dim=128 features, but RoPE rotates an even number of them "
        r"\(at least 2\)"),
    Row("feature-off-partial-rope-on-llama", T, [B, "partial_rotary_factor=0.5"],
        r"partial_rotary_factor=0.5 does nothing without decoder_block=.*glm4_moe \(here decoder_block=llama\)"),
    Row("feature-off-attention-bias-on-llama", T, [B, "attention_bias=true"],
        r"attention_bias=true does nothing without decoder_block=glm4_moe \(here decoder_block=llama\)"),
    Row("glm4_moe-dense-layers-leave-no-experts", T, [B, "model_name=glm-4.5-air", "first_num_dense_layers=46"],
        r"first_num_dense_layers=46 leaves no layer of experts among base_num_decoder_layers=46"),
    Row("output-directory-empty", T, [B, "base_output_directory="], r"base_output_directory is empty .* the run would "
        r"be written into the current directory"),
    # train: post-training (SFT, DPO, LoRA; docs/post_training.md)
    # the old switches (use_sft, use_dpo, use_grpo, use_distillation) still work with a notice; two of them, or one
    # against objective, are refused naming both keys
    Row("sft-and-dpo", T, [B, "use_sft=true", "use_dpo=true"], r"use_sft=true and use_dpo=true were both set; a run "
        r"has one objective: set objective=sft or objective=dpo"),
    Row("old-key-contradicts-objective", T, [B, "objective=sft", "use_dpo=true"], r"use_dpo=true contradicts "
        r"objective=sft: a run has one objective; drop use_dpo"),
    Row("objective-unknown", T, [B, "objective=ppo"], r"objective='ppo' is not allowed: it must be one of: lm, sft, dpo, "
        r"grpo, distill"),
    Row("sft-default-corpus", T, [B, "objective=sft", "train_data_columns=[messages]", "eval_data_columns=[messages]"],
        r"objective=sft reads jsonl or parquet files, but dataset_type=default"),
    Row("dpo-two-columns", T, [B, "objective=dpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                               "train_data_columns=[prompt,chosen]"],
        r"objective=dpo reads preference pairs, but train_data_columns=\['prompt', 'chosen'\]; set "
        r"train_data_columns=\[prompt,chosen,rejected\]"),
    Row("dpo-beta-zero", T, [B, "dpo_beta=0"], r"dpo_beta=0.0 is not allowed: it must be > 0"),
    Row("lora-target-unknown", T, [B, "lora_rank=4", "lora_target_modules=[q_proj,v_proj]"],
        r"lora_target_modules=\['q_proj', 'v_proj'\] must list distinct projections among q, k, v, o, gate, up, down"),
    Row("muon-with-lora", T, [B, "opt_type=muon", "lora_rank=4"],
        r"opt_type=muon trains whole weight matrices, but lora_rank=4 trains low-rank adapters: set opt_type=adamw"),
    Row("chat-template-unknown", T, [B, "chat_template=vicuna"], r"chat_template='vicuna' is not a built-in template"),
    Row("sft-no-chat-template", T, [B, "objective=sft", "dataset_type=jsonl", "tokenizer_path={tok}",
                                    "grain_train_files={scratch}/rows.jsonl", "train_data_columns=[messages]",
                                    "eval_data_columns=[messages]"],
        r"the tokenizer .*tok.model has no chat template.* chat_template.* chatml", tiny=True, setup=jsonl_file([])),
    Row("sft-no-assistant-turn", T, [B, "objective=sft", "dataset_type=jsonl", "tokenizer_path={tok}",
                                     "chat_template=plain", "grain_train_files={scratch}/rows.jsonl",
                                     "train_data_columns=[messages]", "eval_data_columns=[messages]"],
        r"rows.jsonl line 1: the conversation has no assistant turn", tiny=True,
        setup=jsonl_file([{"messages": [{"role": "user", "content": "hi"}]}])),
    Row("sft-unknown-role", T, [B, "objective=sft", "dataset_type=jsonl", "tokenizer_path={tok}",
                                "chat_template=plain", "grain_train_files={scratch}/rows.jsonl",
                                "train_data_columns=[messages]", "eval_data_columns=[messages]"],
        r"rows.jsonl line 1: message 0 has an unknown role 'human'", tiny=True,
        setup=jsonl_file([{"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "x"}]}])),
    Row("sft-eval-file-without-the-column", T, [B, "objective=sft", "dataset_type=jsonl", "tokenizer_path={tok}",
                                                "chat_template=plain", "grain_train_files={scratch}/rows.jsonl",
                                                "grain_eval_files={data}/good.jsonl", "train_data_columns=[messages]",
                                                "eval_data_columns=[messages]"],
        r"good.jsonl line 1: no 'messages' field \(the record has: text\)\. Name the fields with "
        r"eval_data_columns=\[messages\]", tiny=True, setup=jsonl_file([])),
    Row("grpo-columns-without-eval-files", T, [B, "objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                               "train_data_columns=[prompt,answer]"],
        r"objective=grpo samples each prompt's completions with decode_sampling_strategy=greedy"),
    Row("dpo-every-pair-truncated", T, [B, "objective=dpo", "dataset_type=jsonl", "tokenizer_path={tok}",
                                        "chat_template=plain", "grain_train_files={scratch}/pairs.jsonl",
                                        "train_data_columns=[prompt,chosen,rejected]",
                                        "eval_data_columns=[prompt,chosen,rejected]"],
        r"the first preference pair of every train file leaves no token to learn from at max_target_length=32 .* "
        r"Raise max_target_length to \d+ or more", tiny=True,
        setup=lambda w, s: write(os.path.join(s, "pairs.jsonl"), json.dumps(
            {"prompt": "the same long question " * 30, "chosen": "yes", "rejected": "no"}) + "\n")),
    Row("dpo-row-without-rejected", T, [B, "objective=dpo", "dataset_type=jsonl", "tokenizer_path={tok}",
                                        "chat_template=plain", "grain_train_files={scratch}/rows.jsonl",
                                        "train_data_columns=[prompt,chosen,rejected]",
                                        "eval_data_columns=[prompt,chosen,rejected]"],
        r"rows.jsonl line 1: a DPO row needs 'prompt', 'chosen' and 'rejected', but 'rejected' is missing", tiny=True,
        setup=jsonl_file([{"prompt": "1+1=", "chosen": "2"}])),
    # train: distillation (docs/post_training.md, "Distillation"); refused before any data or compile work
    Row("distill-no-teacher", T, [B, "objective=distill"], r"objective=distill needs a teacher: set "
        r"distill_teacher_path="),
    Row("distill-alpha-above-one", T, [B, "distill_alpha=1.5"], r"distill_alpha=1.5 is not allowed: it must be in "
        r"\[0, 1\]"),
    Row("distill-temperature-zero", T, [B, "distill_temperature=0"], r"distill_temperature=0.0 is not allowed: it "
        r"must be > 0"),
    Row("distill-and-dpo", T, [B, "use_distillation=true", "distill_teacher_path={run}", "use_dpo=true",
                               "dataset_type=jsonl", "grain_train_files=x.jsonl",
                               "train_data_columns=[prompt,chosen,rejected]", "eval_data_columns=[prompt,chosen,rejected]"],
        r"use_distillation=true and use_dpo=true were both set; a run has one objective"),
    Row("distill-pipeline-stages", T, [B, "objective=distill", "distill_teacher_path={run}",
                                       "ici_pipeline_parallelism=2"],
        r"objective=distill does not run with pipeline parallelism yet; set ici_pipeline_parallelism=1"),
    Row("distill-teacher-missing", T, [B, "objective=distill", "distill_teacher_path={scratch}/none",
                                       "run_name=new", "base_output_directory={scratch}"],
        r"distill_teacher_path='.*/none' does not exist", tiny=True),
    Row("distill-teacher-other-vocab", T, [B, "objective=distill", "distill_teacher_path={run}", "vocab_size=256",
                                           "run_name=new", "base_output_directory={scratch}"],
        r"the teacher .*/run/checkpoints/4 predicts a vocabulary of 512 tokens and the student 256; .* same tokenizer",
        tiny=True),
    # train: on-policy distillation (docs/post_training.md, "On-policy distillation"): keys that do nothing there, and
    # a run without prompt data, refused before any data or compile work
    Row("opd-no-teacher", T, [B, *OPD[1:]], r"objective=distill_on_policy needs a teacher: set distill_teacher_path="),
    Row("opd-distill-alpha", T, [B, *OPD, "distill_alpha=0.3"], r"distill_alpha=0.3 does nothing without "
        r"objective=distill \(here objective=distill_on_policy\): set objective=distill .*, or drop distill_alpha"),
    Row("opd-distill-data", T, [B, *OPD, "distill_data=conversations"], r"distill_data='conversations' does nothing "
        r"without objective=distill \(here objective=distill_on_policy\)"),
    Row("opd-distill-temperature", T, [B, *OPD, "distill_temperature=2"], r"distill_temperature=2.0 does nothing "
        r"without objective=distill \(here objective=distill_on_policy\)"),
    Row("opd-grpo-beta", T, [B, *OPD, "grpo_beta=0.1"], r"grpo_beta=0.1 does nothing without objective=grpo "
        r"\(here objective=distill_on_policy\)"),
    Row("opd-without-prompt-data", T, [B, "objective=distill_on_policy", "distill_teacher_path={run}",
                                       "decode_sampling_strategy=weighted"],
        r"objective=distill_on_policy reads jsonl or parquet files, but dataset_type=.*; set dataset_type=jsonl"),
    Row("opd-greedy-sampler", T, [B, *OPD[:-1]], r"objective=distill_on_policy samples the student's completions with "
        r"decode_sampling_strategy=greedy.* Set decode_sampling_strategy=weighted"),
    Row("opd-prompt-length-under-offline-distill", T, [B, "objective=distill", "distill_teacher_path={run}",
                                                       "max_prefill_predict_length=32"],
        r"max_prefill_predict_length=32 does nothing without objective=grpo or distill_on_policy \(here "
        r"objective=distill\)"),
    # train: YAML files
    Row("yaml-missing", T, ["{scratch}/none.yml"], r"config file '.*/none.yml' does not exist"),
    Row("yaml-empty", T, ["{scratch}/my.yml"], r"config file '.*/my.yml' is empty", setup=yaml_file("")),
    Row("yaml-key-twice", T, ["{scratch}/my.yml"], r"config file '.*/my.yml' sets steps twice \(line 1 and line 3\)",
        setup=yaml_file("steps: 3\nseed: 1\nsteps: 5\n")),
    Row("yaml-invalid", T, ["{scratch}/my.yml"], r"config file '.*/my.yml' is not valid YAML at line 2",
        setup=yaml_file("steps: [3\nseed: 1\n")),
    Row("yaml-a-list", T, ["{scratch}/my.yml"], r"must be a mapping of `key: value` lines, but it is a list",
        setup=yaml_file("- steps: 3\n")),
    Row("yaml-unknown-key", T, ["{scratch}/my.yml"], r"/my.yml: unknown config key 'stepz': did you mean steps\?",
        setup=yaml_file("base_config: {base}\nstepz: 3\n")),
    Row("yaml-base-missing", T, ["{scratch}/my.yml"], r"base_config 'nowhere.yml' does not exist",
        setup=yaml_file("base_config: nowhere.yml\nsteps: 3\n")),
    Row("yaml-base-cycle", T, ["{scratch}/my.yml"], r"base_config cycle", setup=yaml_file("base_config: my.yml\n")),
    Row("yaml-range", T, ["{scratch}/my.yml"], r"adam_eps=-1.0 is not allowed",
        setup=yaml_file("base_config: {base}\nadam_eps: -1\n")),
    # train: multi-process settings (refused before any wait)
    Row("port-above-65535", T, [B, "coordinator_address=127.0.0.1:99999", "num_processes=2", "process_id=1"],
        r"coordinator_address='127.0.0.1:99999': port 99999 is outside 1-65535"),
    Row("address-without-port", T, [B, "coordinator_address=10.0.0.1", "num_processes=2", "process_id=0"],
        r"coordinator_address='10.0.0.1' must be host:port"),
    Row("process-id-out-of-range", T, [B, "coordinator_address=127.0.0.1:1234", "num_processes=2", "process_id=2"],
        r"process_id=2 must be in \[0, num_processes=2\)"),
    Row("grpo-on-two-processes", T, [B, "objective=grpo", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                     "train_data_columns=[prompt,answer]", "decode_sampling_strategy=weighted",
                                     "coordinator_address=127.0.0.1:1234", "num_processes=2", "process_id=1"],
        r"objective=grpo samples in the trainer's one process \(grpo_rollout_workers=0\), but num_processes=2; set "
        r"grpo_rollout_workers >= 1"),
    Row("grpo-dynamic-sampling-on-two-processes", T, [B, "objective=grpo", "dataset_type=jsonl",
                                                      "grain_train_files=x.jsonl", "train_data_columns=[prompt,answer]",
                                                      "decode_sampling_strategy=weighted", "grpo_rollout_workers=1",
                                                      "grpo_dynamic_sampling=true", "coordinator_address=127.0.0.1:1234",
                                                      "num_processes=2", "process_id=1"],
        r"grpo_dynamic_sampling=true decides its further prompt draws on one host, but num_processes=2; set "
        r"grpo_dynamic_sampling=false"),
    # GRPO's multi-turn environments (maxtrain/training/environments.py, episodes.py)
    Row("grpo-environment-under-sft", T, [B, "objective=sft", "dataset_type=jsonl", "grain_train_files=x.jsonl",
                                          "train_data_columns=[messages]", "grpo_environment=calculator"],
        r"grpo_environment='calculator' does nothing without objective=grpo"),
    Row("grpo-max-turns-without-environment", T, [B, *GRPO, "grpo_max_turns=3"],
        r"grpo_max_turns=3 does nothing without an environment \(multi-turn episodes; a single-turn completion has "
        r"one turn\) \(here grpo_environment=\"\"\): set grpo_environment=calculator \(or module:Class\), or drop "
        r"grpo_max_turns"),
    Row("grpo-environment-not-a-path", T, [B, *GRPO, "grpo_environment=maze"],
        r"grpo_environment='maze' is neither a built-in environment \(calculator\) nor an import path module:Class"),
    Row("grpo-max-turns-zero", T, [B, *GRPO, "grpo_environment=calculator", "grpo_max_turns=0"],
        r"grpo_max_turns=0 is not allowed"),
    Row("grpo-environment-with-rollout-workers", T, [B, *GRPO, "grpo_environment=calculator", "grpo_rollout_workers=1"],
        r"grpo_environment='calculator' plays its episodes in the trainer; the rollout workers sample single-turn "
        r"completions only \(yet\); set grpo_rollout_workers=0"),
    Row("grpo-routing-replay-with-environment", T, [B, *GRPO, "decoder_block=mixtral", "num_experts=4",
                                                    "num_experts_per_tok=2", "grpo_routing_replay=true",
                                                    "grpo_environment=calculator"],
        r"grpo_routing_replay=true does not record the experts of multi-turn episodes yet .*set "
        r"grpo_routing_replay=false"),
    Row("processes-without-coordinator", T, [B, "num_processes=2", "process_id=0"],
        r"num_processes=2 needs coordinator_address=host:port"),
    # train: outputs
    Row("metrics-file-under-a-file", T, [B, "metrics_file={scratch}/afile/m.jsonl"],
        r"metrics_file='.*/afile/m.jsonl' cannot be created: .*/afile is a file", setup=a_file),
    Row("metrics-file-is-a-directory", T, [B, "metrics_file={scratch}"], r"metrics_file='.*' is a directory"),
    Row("output-under-a-file", T, [B, "base_output_directory={scratch}/afile"],
        r"base_output_directory='.*/afile' .*is a file", setup=a_file),
    Row("run-directory-is-a-file", T, [B, "base_output_directory={scratch}", "run_name=afile"],
        r"the run directory '.*/afile' is a file, not a directory.* choose another run_name", setup=a_file),
    Row("dataset-cache-dir-under-a-file", T, [B, "dataset_cache_dir={scratch}/afile/cache"],
        r"dataset_cache_dir='.*/afile/cache' cannot be created: .*/afile is a file", setup=a_file),
    Row("run-name-escapes-the-output-directory", T, [B, "base_output_directory={scratch}", "run_name=../../x"],
        r"run_name='../../x' must be one directory name .* set base_output_directory; e.g. "
        r"base_output_directory=.* run_name=x"),
    Row("run-name-absolute", T, [B, "run_name={scratch}/elsewhere"], r"run_name='.*/elsewhere' must be one directory "
        r"name"),
    # train: data
    Row("jsonl-without-files", T, [B, "dataset_type=jsonl"], r"dataset_type=jsonl needs grain_train_files"),
    Row("glob-matches-nothing", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                    "grain_train_files={data}/nothing*.jsonl"],
        r"grain_train_files: '.*/nothing\*.jsonl' matches no files", tiny=True),
    Row("train-files-a-directory", T, [B, "dataset_type=arrayrecord", "grain_train_files={prepared}"],
        r"grain_train_files: '.*/prepared' is a directory, not a glob of files: name its files, e.g. "
        r"'.*/prepared/train-\*\.arrayrecord'", tiny=True),
    Row("eval-files-a-directory", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                      "grain_train_files={data}/good.jsonl", "grain_eval_files={data}/"],
        r"grain_eval_files: '.*/data/' is a directory, not a glob of files: name its files, e.g. '.*/data/\*\.jsonl' "
        r"\(it holds \d+ \.jsonl", tiny=True),
    Row("jsonl-files-a-prepared-directory", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                "grain_train_files={prepared}"],
        r"'.*/prepared' is a directory of prepared \(tokenized\) data, not jsonl files: read it with "
        r"dataset_type=arrayrecord", tiny=True),
    Row("mixture-weight-not-a-number", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                           "grain_train_files={data}/good*:abc"],
        r"the weight of '.*/good\*' is 'abc', which is not a number", tiny=True),
    Row("mixture-weight-infinite", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                       "grain_train_files={data}/good*:inf"],
        r"the weight of '.*/good\*' is inf; weights must be finite and > 0", tiny=True),
    Row("mixture-weight-zero", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                   "grain_train_files={data}/good*:0"],
        r"weights must be finite and > 0", tiny=True),
    Row("mixture-weight-without-glob", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}", "grain_train_files=:0.5"],
        r"':0.5' has a weight but no files before it", tiny=True),
    Row("jsonl-not-json", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                              "grain_train_files={data}/bad_json.jsonl"],
        r"bad_json.jsonl line 1: not valid JSON", tiny=True),
    Row("jsonl-text-not-a-string", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                       "grain_train_files={data}/nonstring.jsonl"],
        r"nonstring.jsonl line 1: field 'text' holds a int, not a string", tiny=True),
    Row("jsonl-no-text-field", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                   "grain_train_files={data}/no_field.jsonl"],
        r"no_field.jsonl line 1: no 'text' field \(the line has: body\)", tiny=True),
    Row("jsonl-train-file-without-the-column", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                   "grain_train_files={data}/good.jsonl", "train_data_columns=[body]",
                                                   "grain_eval_files={data}/no_field.jsonl",
                                                   "eval_data_columns=[body]"],
        r"good.jsonl line 1: no 'body' field \(the line has: text\)\. Name the text field with "
        r"train_data_columns=\[NAME\]", tiny=True),
    Row("jsonl-eval-file-without-the-column", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                                  "grain_train_files={data}/good.jsonl",
                                                  "grain_eval_files={data}/no_field.jsonl"],
        r"no_field.jsonl line 1: no 'text' field \(the line has: body\)\. Name the text field with "
        r"eval_data_columns=\[NAME\]", tiny=True),
    Row("parquet-eval-file-without-the-column", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                                    "grain_train_files={data}/no_text_column.parquet",
                                                    "train_data_columns=[body]",
                                                    "grain_eval_files={data}/no_text_column.parquet"],
        r"no_text_column.parquet: no column 'text' \(columns: body\)\. Name the text column with "
        r"eval_data_columns=\[NAME\]", tiny=True),
    Row("jsonl-empty-file", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                "grain_train_files={data}/empty.jsonl"], r"empty.jsonl is empty", tiny=True),
    Row("jsonl-bad-utf8", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                              "grain_train_files={data}/bad_utf8.jsonl"],
        r"bad_utf8.jsonl line 1: invalid UTF-8", tiny=True),
    Row("parquet-not-parquet", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                   "grain_train_files={data}/not.parquet"],
        r"not.parquet: not a readable parquet file", tiny=True),
    Row("parquet-no-text-column", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                      "grain_train_files={data}/no_text_column.parquet"],
        r"no_text_column.parquet: no column 'text' \(columns: body\)", tiny=True),
    Row("parquet-column-not-text", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                       "grain_train_files={data}/int_column.parquet"],
        r"int_column.parquet: column 'text' has type int64, not string", tiny=True),
    Row("jsonl-as-parquet", T, [B, "dataset_type=parquet", "tokenizer_path={tok}",
                                "grain_train_files={data}/good.jsonl"],
        r"good.jsonl is a jsonl file but dataset_type=parquet", tiny=True),
    Row("unknown-file-type", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}", "grain_train_files={data}/table.csv"],
        r"table.csv: unknown file type", tiny=True),
    Row("tokenizer-missing", T, [B, "dataset_type=jsonl", "tokenizer_path={scratch}/none.model",
                                 "grain_train_files={data}/good.jsonl"],
        r"tokenizer_path='.*/none.model' does not exist", tiny=True),
    Row("tokenizer-garbage", T, [B, "dataset_type=jsonl", "tokenizer_path={root}/garbage.model",
                                 "grain_train_files={data}/good.jsonl"],
        r"garbage.model'? is not a (valid )?sentencepiece model", tiny=True),
    Row("default-corpus-vocab-below-characters", T, [B, "vocab_size=10"],
        r"vocab_size=10 is too small for this text: .* Use vocab_size=\d+ or more", tiny=True),
    Row("step-larger-than-memory", T, [B, "per_device_batch_size=10000000"],
        r"the compiled train step needs [\d,.]+ GiB per device .*, more than the [\d,.]+ GiB it can have .* Try a "
        r"smaller per_device_batch_size \(now 10000000", tiny=True),
    Row("tokenizer-larger-than-vocab", T, [B, "dataset_type=jsonl", "tokenizer_path={tok}",
                                           "grain_train_files={data}/good.jsonl", "vocab_size=256"],
        r"has 400 pieces but vocab_size=256", tiny=True),
    Row("arrayrecord-without-metadata", T, [B, "dataset_type=arrayrecord", "grain_train_files={scratch}/x.arrayrecord"],
        r"has no metadata.json", tiny=True, setup=lambda w, s: write(os.path.join(s, "x.arrayrecord"), "x")),
    Row("arrayrecord-other-tokenizer", T, [B, "dataset_type=arrayrecord", "tokenizer_path={root}/garbage.model",
                                           "grain_train_files={prepared}/train-*.arrayrecord"],
        r"garbage.model'? is not a (valid )?sentencepiece model", tiny=True),
    # train: checkpoints
    Row("load-parameters-missing", T, [B, "load_parameters_path={scratch}/none", "run_name=new",
                                       "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"load_parameters_path='.*/none' does not exist", tiny=True),
    Row("load-parameters-empty-dir", T, [B, "load_parameters_path={scratch}/nothing", "run_name=new",
                                         "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"load_parameters_path='.*/nothing' holds no complete checkpoint", tiny=True, setup=empty_dir),
    Row("load-parameters-does-not-fit", T, [B, "load_parameters_path={run}", "run_name=new", "base_emb_dim=64",
                                            "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"the checkpoint .*/run/checkpoints/4 \(load_parameters_path\) does not fit the configured model", tiny=True),
    Row("load-full-state-other-optimizer", T, [B, "load_full_state_path={run}", "opt_type=muon", "run_name=new",
                                               "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"/run/checkpoints/4 \(load_full_state_path\) holds the optimizer state of opt_type=adamw, not of "
        r"opt_type=muon: continue it with opt_type=adamw", tiny=True),
    Row("moe-preset-dense-checkpoint", T, [B, "model_name=mixtral-8x7b", "load_parameters_path={run}", "run_name=new",
                                           "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"holds a dense llama model \(no experts\), but this run's model is a mixture of experts \(mixtral, 8 experts, "
        r"2 per token\)", tiny=True),
    Row("load-parameters-bit-flipped", T, [B, "load_parameters_path={scratch}/run/checkpoints/4", "run_name=new",
                                           "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"is damaged: .*/checkpoints/4/state/.*: its contents changed since it was saved", tiny=True, setup=flipped),
    Row("load-full-state-truncated", T, [B, "load_full_state_path={scratch}/run/checkpoints/4", "run_name=new",
                                         "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"is damaged: .*/checkpoints/4/state/.* has \d+ bytes, but \d+ were saved", tiny=True, setup=truncated),
    Row("resume-past-steps", T, [B, "run_name=run", "base_output_directory={scratch}", "dataset_cache_dir={cache}",
                                 "steps=2"],
        r"checkpoint .*/run/checkpoints/4 is at step 4, steps=2: nothing to train; raise steps", code=0, tiny=True,
        setup=lambda w, s: copy_run(w, s)),
    Row("resume-bit-flipped-falls-back", T, [B, "run_name=run", "base_output_directory={scratch}",
                                             "dataset_cache_dir={cache}", "steps=2"],
        r"checkpoint step 4 is damaged: .*/checkpoints/4/state/.*: its contents changed since it was saved .*\. Moved "
        r"it to .*/run/damaged_checkpoints/4", code=0, tiny=True, setup=flipped),
    Row("resume-state-deleted-falls-back", T, [B, "run_name=run", "base_output_directory={scratch}",
                                               "dataset_cache_dir={cache}", "steps=2"],
        r"checkpoint step 4 is damaged: .*/checkpoints/4/state is missing", code=0, tiny=True, setup=no_state),
    Row("resume-every-step-damaged", T, [B, "run_name=run", "base_output_directory={scratch}",
                                         "dataset_cache_dir={cache}", "steps=2"],
        r"no usable checkpoint is left in .*/run/checkpoints: every step was damaged \(step 2: .*: its contents "
        r"changed since it was saved \(checksum mismatch\)\) and was moved to .*/run/damaged_checkpoints",
        tiny=True, setup=every_step_flipped),
    Row("resume-with-another-objective", T, [B, "run_name=run", "base_output_directory={scratch}",
                                             "dataset_cache_dir={cache}", "objective=distill",
                                             "distill_teacher_path={run}", "steps=6"],
        r"this run's checkpoint .*/run/checkpoints/4 was trained with objective=lm, and this run has objective=distill: "
        r"the objective changed\. Start the new stage as a new run from its parameters \(run_name=<a new name> "
        r"load_parameters_path=", tiny=True, setup=lambda w, s: copy_run(w, s)),
    Row("load-full-state-of-another-objective", T, [B, "load_full_state_path={run}", "objective=distill",
                                                    "distill_teacher_path={run}", "run_name=new",
                                                    "base_output_directory={scratch}", "dataset_cache_dir={cache}"],
        r"load_full_state_path=.*/run/checkpoints/4 holds the state of a run with objective=lm .* the objective "
        r"changed\. Start the new stage from its parameters: load_parameters_path=", tiny=True),
    # train: the checks see the model a checkpoint's settings make (adopted where the command sets no model_name)
    Row("imported-deepseek-expert-parallelism", T, [B, "load_parameters_path={scratch}/ds", "ici_expert_parallelism=3",
                                                    "dataset_type=synthetic"],
        r"expert parallelism 3 .* must divide num_experts=8", setup=imported(DEEPSEEK)),
    Row("imported-deepseek-routing-key", T, [B, "load_parameters_path={scratch}/ds", "topk_routing_group=8",
                                             "dataset_type=synthetic"],
        r"topk_routing_group=8 is more than n_routing_groups=4", setup=imported(DEEPSEEK)),
    Row("imported-deepseek-mtp-key", T, [B, "load_parameters_path={scratch}/ds", "mtp_num_layers=1",
                                         "dataset_type=synthetic", "max_target_length=32", "per_device_batch_size=1",
                                         "run_name=new", "base_output_directory={scratch}"],
        r"the checkpoint .*/ds/checkpoints/0 \(load_parameters_path\) does not fit the configured model",
        setup=imported(DEEPSEEK)),
    Row("imported-tokenizer-other-than-the-prepared-data", T, [B, "load_parameters_path={scratch}/ds",
                                                               "dataset_type=arrayrecord", "max_target_length=32",
                                                               "grain_train_files={prepared}/train-*.arrayrecord",
                                                               "per_device_batch_size=1", "run_name=new",
                                                               "base_output_directory={scratch}"],
        r"but the model's tokenizer, .*/ds/hf \(adopted from its checkpoint\), has checksum \w+: .* Prepare the data "
        r"again with prepare_data.py --tokenizer .*/ds/hf", setup=imported(LLAMA, tokenizer=True)),
    Row("attention-cudnn-on-cpu", T, [B, "attention=cudnn"], r"attention=cudnn needs an NVIDIA GPU", tiny=True),
    Row("attention-tokamax-on-cpu", T, [B, "attention=tokamax"], r"attention=tokamax needs an NVIDIA GPU", tiny=True),
    Row("mesh-does-not-fit-devices", T, [B, "ici_data_parallelism=3"], r"ici_data_parallelism|devices", tiny=True),
    Row("train-sample-prompt-empty", T, [B, "dataset_type=synthetic", "tokenizer_path={tok}", "prompt=",
                                         "max_new_tokens=4"],
        r"prompt='' is empty: .* \(it is the prompt of the greedy sample after training; max_new_tokens=0 skips",
        tiny=True),
    Row("eval-tasks-with-a-set-tokenizer-path", T, [B, "dataset_type=synthetic", "tokenizer_path={tok}",
                                                    "eval_tasks=arc_easy", "eval_tasks_cache_dir={scratch}/none"],
        r"no prepared evaluation data in .*/none", tiny=True),
    # a fractional per_device_batch_size (issue 60, config/batch.py): whole rows per micro-batch and batch axis
    Row("batch-fraction-not-whole-rows", T, [B, "per_device_batch_size=0.1", "ici_context_parallelism=8"],
        r"per_device_batch_size=0.1 on 8 devices makes a micro-batch of 0.8 sequences; it must be whole rows: use "
        r"per_device_batch_size=0.125 \(1 row\)"),
    Row("batch-fraction-batch-axes-cannot-split", T, [B, "per_device_batch_size=0.125"],
        r"the micro-batch of 1 row \(per_device_batch_size x devices\) does not split over the batch axes' 8 ways "
        r"\(fsdp 8\); make the micro-batch a multiple of 8"),
]
