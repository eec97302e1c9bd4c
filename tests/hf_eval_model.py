"""A tiny random Llama with a real byte-level BPE tokenizer, saved as a Hugging Face directory that
both transformers/lm-eval and maxtrain (scripts/convert_hf.py import, maxtrain.data.tokenizer.load) read.

The tokenizer is trained with the `tokenizers` library on the evaluation texts themselves (a few
thousand lines), adds BOS as Llama's tokenizers do, and is saved with tokenizer_config.json.
"""

from __future__ import annotations

from maxtrain.evals import data as data_lib

VOCAB = 1024


def training_texts(cache_dir: str) -> list[str]:
    files = data_lib.open_cache(cache_dir, ["hellaswag", "boolq", "piqa", "arc_easy"])
    texts = []
    for row in data_lib.read_rows(files["hellaswag"]["validation"])[:1500]:
        texts += [row["ctx"], *row["endings"]]
    for row in data_lib.read_rows(files["boolq"]["validation"])[:300]:
        texts += [row["passage"], row["question"]]
    for row in data_lib.read_rows(files["piqa"]["validation"])[:300]:
        texts += [row["goal"], row["sol1"], row["sol2"]]
    return texts + ["Question: Answer: A. B. C. D. The following are multiple choice questions (with answers) about"]


def make(hf_dir: str, cache_dir: str, seed: int = 0) -> str:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=import-outside-toplevel

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(training_texts(cache_dir), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[
        ("<s>", tok.token_to_id("<s>"))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", model_max_length=4096)
    fast.save_pretrained(hf_dir)

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rope_theta=10000.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
                                   bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
                                   pad_token_id=tok.token_to_id("<pad>"))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # lively logits, so that choices are rarely near ties
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(hf_dir)
    return hf_dir

