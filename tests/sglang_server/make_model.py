"""A test fixture: a tiny random Llama with a byte-level BPE tokenizer trained here, saved in a
folder SGLang's server loads (``python make_model.py DIR``; run with the SGLang venv's python).

3 layers, hidden 256, 4 attention heads, 2 KV heads of 64, random weights (seed 5): its text is
meaningless, but greedy decoding is deterministic, so an answer computed from cached KV can be
compared with one computed from scratch. No hub access: the tokenizer is trained on ``WORDS``.
"""

from __future__ import annotations

import sys

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly "
    "bank clerk near old zoo gates and many other random words appear"
).split()


def corpus() -> list[str]:
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(400)]


def main(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="</s>",
    )  # fmt: skip
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_hidden_layers=3, intermediate_size=512, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(5)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1])
