"""The model: params, RoPE, blocks, attention, MoE, the decoder stack, and the families over them.

    params.py     ParamSpec: every parameter declared once (shape, logical axes, initializer)
    rope.py       RoPE and its scaling variants (default, linear, llama3, yarn)
    ops.py        the matmul (`dense`) and small array helpers, with their CPU formulations
    attention.py  masks, the plain-jnp reference, the kernels' dispatch, the context-parallel form
    attention_check.py  implementations against the float32 reference; attention FLOPs (gpu_report.py)
    attention_choice.py what each attention implementation supports, autoselected's choice (per layer kind)
    mla.py        multi-head latent attention (DeepSeek): low-rank queries, a cached latent for keys and values
    blocks.py     norms, embedding, attention, gated MLPs, logits; FLOPs helpers
    layers.py     a layer's kind as data (LayerType): its parameter stack, mixer, attention, RoPE, head dim, MLP
    contract.py   the family contract (FamilyModel): everything the rest of maxtrain uses from a family
    standard_layers.py  the decoder layers several families share (pre-norm, Gemma's sandwich), embed, heads
    moe.py        the mixture-of-experts block: routers, dropless and capacity dispatch, experts,
                  balance losses, expert parallelism (docs/moe.md)
    moe_deepseek.py  DeepSeek's parts of it: sigmoid group-limited router, the selection bias and its
                  update outside the gradient, shared experts (docs/deepseek.md)
    moe_llama4.py Llama 4's router: sigmoid weights of the top-k logits on the experts' inputs
    decoder.py    the stack every family shares: layer types, scan over repeating groups, loss, decoding
    mtp.py        multi-token prediction (DeepSeek-V3): modules after the stack, predicting tokens further ahead
    distill.py    distillation's loss: KL to a frozen teacher's logits mixed with the next-token loss, tiled
    runtime.py    dtype, attention implementation, remat policy and vocab tiles resolved for a platform
    lora.py       LoRA adapters: their declarations, initialization and merge into the weights
    sampling.py   sampling with the KV cache: greedy, temperature, top-k, top-p
    hf.py         what the families share about Hugging Face names and config.json fields
    families/     one module per family of config/registry.py (llama, mistral, qwen2, qwen3, gemma2,
                  gemma3, mixtral, qwen3_moe, gpt_oss, deepseek, llama4_text, glm4_moe): declarations, layer
                  composition, HF mapping, FLOPs

    model.py      the model bound once (Model.bind(config)): the family, its config and its layers' kinds,
                  with forward, loss, decoding's cache, FLOPs and the parameter declarations
    model_keys.py the config keys that describe a model (a checkpoint is checked against them)

`decoder_block` (MaxText's key; presets set it) picks the family, in Model.bind and nowhere else. Every
function here is a pure function of (params, inputs, model or config, runtime). May import config, parallel and kernels (and errors);
never training, checkpointing, data or the commands.
"""
