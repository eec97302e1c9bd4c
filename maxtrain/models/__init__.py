"""The model: one bound Model over a family's folder and the shared parts, each named by its mechanism.

    model.py      the model bound once (Model.bind(config)): the family, its config and its layers' kinds, with
                  forward, loss, decoding's cache, FLOPs and the parameter declarations; what flows below
    model_keys.py the config keys that describe a model (a checkpoint is checked against them)
    contract.py   the family contract (FamilyModel): everything the rest of maxtrain uses from a family
    layers.py     a layer's kind as data (LayerType): its parameter stack, mixer, attention, RoPE, head dim, MLP
    decoder.py    the stack every family shares: scan over repeating groups, loss, decoding; the objective's sum
    aux_names.py  the aux entries the decoder reports per layer (and the step's statistics) rather than sums
    params.py     ParamSpec: every parameter declared once (shape, logical axes, initializer)
    rope.py       RoPE and its scaling variants (default, linear, llama3, yarn)
    ops.py        the matmul (`dense`) and small array helpers, with their CPU formulations
    blocks.py     norms, embedding, attention's projections, gated MLPs, logits; FLOPs helpers
    standard_layers.py  the decoder layers several families share (pre-norm, Gemma's sandwich), embed, heads
    attention/    masks, the plain-jnp reference, the kernels' dispatch and the context-parallel form
                  (__init__); kernel_check.py: implementations against the float32 reference, attention FLOPs;
                  kernel_choice.py: what each implementation supports, autoselected's choice per layer kind
    moe/          the mixture-of-experts block (__init__: routers, dropless and capacity dispatch, balance
                  losses, expert parallelism; docs/moe.md); expert_matmuls.py: the experts' grouped and batched
                  SwiGLU; sigmoid_groups.py: the sigmoid group-limited router, its selection bias and the shared
                  experts (docs/deepseek.md); topk_sigmoid.py: sigmoid weights of the top-k on the experts' inputs
    recurrent/    the gated delta rule, the gated delta-net layer and the hybrid stack families compose with it
    llama4/       Llama 4's text decoder (chunked attention, NoPE layers, experts), composed by llama4_text and llama4
    vision/       vision towers as blocks with their Hugging Face names (qwen.py: Qwen3-VL's and Qwen3.5's ViT;
                  gemma4.py: Gemma 4's encoder and projector; llama4.py: Llama 4's tile encoder and projector)
    mtp.py        multi-token prediction: modules after the stack, predicting tokens further ahead
    distill.py    distillation's loss: KL to a frozen teacher's logits mixed with the next-token loss, tiled
    fp8.py        float8 matmuls (quantization=fp8)
    runtime.py    dtype, attention implementation, remat policy and vocab tiles resolved for a platform
    lora.py       LoRA adapters: their declarations, initialization and merge into the weights
    sampling.py   sampling with the KV cache: greedy, temperature, top-k, top-p
    hf.py         Hugging Face names, config.json fields and the layouts that convert a tensor (each owns its rule)
    families/     one folder per family of config/registry.py: its module (declarations, layer composition, HF
                  mapping, FLOPs, ending in its MODEL) and what only it uses (Gemma 4's normed attention,
                  per-layer embeddings and parallel MoE; DeepSeek's MLA; OLMo 3's post-norm layer)

A shared part used by one family alone lives in that family's folder (tests/house/test_house.py). `decoder_block`
(MaxText's key; presets set it) picks the family, in Model.bind and nowhere else. Every function here is a
pure function of (params, inputs, model or config, runtime). May import config, parallel and kernels (and
errors); never training, checkpointing, data or the commands.
"""
