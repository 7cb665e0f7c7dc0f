"""Makes the model of the engine tests and benchmarks offline: a random-weight Llama and a BPE tokenizer trained
from a word list.

Runs in the engine venv (transformers, tokenizers): ``python tiny_model.py OUT_DIR [--layers N --hidden N ...]``.
Deterministic: the same arguments give the same weights and vocabulary, so every engine process and the HF
reference see the same model. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "dor", "fen", "gil", "hax", "jun"]


def words(n: int, *, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def make_tokenizer(out: Path, *, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(words(40, seed=i)) for i in range(400)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)


def make_model(out: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 / hidden**0.5 * 8)  # large enough that K/V and logits differ clearly per token
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(a.out, vocab_size=a.vocab)
    make_model(a.out, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, vocab=a.vocab, seed=a.seed)
    (a.out / "kvgate-tiny.json").write_text(json.dumps(vars(a), default=str))


if __name__ == "__main__":
    main()
