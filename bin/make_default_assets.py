#!/usr/bin/env python3
"""Regenerate the bundled default corpus and tokenizer in engine/assets/ (deterministic).

The corpus is synthetic on purpose: it needs no download, a tiny model learns it in minutes on a CPU,
and its arithmetic lines give GRPO a task with checkable answers later.
    python bin/make_default_assets.py
"""
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parent.parent / "engine" / "assets"
NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
THINGS = ["apples", "books", "coins", "shells", "stones", "cards", "cups", "pens"]
PLACES = ["the market", "the library", "the park", "the harbor", "the school", "the garden"]


def arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 50), rng.randint(0, 50)
    op = rng.choice(["+", "-"])
    if op == "-" and b > a:
        a, b = b, a
    return f"Q: {a} {op} {b} = ? A: {a + b if op == '+' else a - b}"


def story(rng: random.Random) -> str:
    n, m = rng.choice(NAMES), rng.choice(NAMES)
    k, j = rng.randint(1, 20), rng.randint(1, 20)
    t, p = rng.choice(THINGS), rng.choice(PLACES)
    return (f"{n} went to {p} with {k} {t}. {m} gave {n} {j} more. "
            f"Now {n} has {k + j} {t}.")


def make_prompts(n_eval: int = 200, seed: int = 1) -> None:
    """GRPO's bundled task: the corpus's arithmetic questions, split into train and held-out prompts."""
    rng = random.Random(seed)
    items = [(a, op, b) for a in range(51) for b in range(51) for op in "+-" if op == "+" or a >= b]
    rng.shuffle(items)
    for name, part in (("arith_eval.jsonl", items[:n_eval]), ("arith_train.jsonl", items[n_eval:])):
        with open(ASSETS / name, "w") as f:
            for a, op, b in part:
                f.write(json.dumps({"prompt": f"Q: {a} {op} {b} = ? A:", "answer": str(a + b if op == "+" else a - b)}) + "\n")


def main(n_docs: int = 20000, vocab_size: int = 512, seed: int = 0) -> None:
    rng = random.Random(seed)
    docs = [" ".join(arithmetic(rng) if rng.random() < 0.6 else story(rng) for _ in range(rng.randint(2, 6)))
            for _ in range(n_docs)]
    ASSETS.mkdir(parents=True, exist_ok=True)
    with open(ASSETS / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<|bos|>", "<|eos|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>")
    fast.save_pretrained(ASSETS / "tokenizer")
    make_prompts()
    print(f"wrote {len(docs)} docs and a {len(fast)}-token tokenizer to {ASSETS}")


if __name__ == "__main__":
    main()
