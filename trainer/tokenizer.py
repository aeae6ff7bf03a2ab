"""The byte-level BPE tokenizer, trained on the training split with Hugging Face `tokenizers`.

Byte-level with GPT-2's pre-tokenizer regex, which llama.cpp runs for `tokenizer.ggml.pre =
"gpt-2"`, so llama.cpp tokenizes text exactly as training did. The chat markers are single
control tokens.
"""

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END_OF_TEXT = "<|endoftext|>"
SPECIALS = [END_OF_TEXT, "<|im_start|>", "<|im_end|>"]


def train(texts, vocab_size):
    """A tokenizer of `vocab_size` tokens (the specials first) trained on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def vocabulary(tok):
    """(tokens by id, llama.cpp token types, merges as "a b" strings)."""
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    types = [3 if t in SPECIALS else 1 for t in tokens]  # LLAMA_TOKEN_TYPE_CONTROL / NORMAL
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges
