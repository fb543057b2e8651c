"""Builds the debug corpus and tokenizer shipped in ``dtrain/assets/debug``.

The corpus is English prose the project may ship: the docstrings of the Python standard library
of the interpreter running this script (PSF licence), read with ``ast`` (nothing is imported), one
JSON line per module. The tokenizer is a byte-level BPE trained on that corpus with HF
``tokenizers``, with Llama 3's BOS/EOS names.

    python tools/make_debug_assets.py --out dtrain/assets/debug
"""

import argparse
import ast
import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def module_docstrings(path: Path) -> str:
    """The module's, classes' and functions' docstrings of one source file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return ""
    nodes = [tree] + [
        n for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    docs = [ast.get_docstring(n) for n in nodes]
    return "\n\n".join(d for d in docs if d and len(d) > 40 and d.isascii())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("dtrain/assets/debug"))
    parser.add_argument("--max-mb", type=float, default=3.0, help="corpus size cap")
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not {"test", "tests", "site-packages", "idlelib"} & set(p.parts))
    texts, size = [], 0
    for path in files:
        text = module_docstrings(path)
        if len(text) < 500:
            continue
        texts.append({"text": text, "source": str(path.relative_to(stdlib))})
        size += len(text)
        if size > args.max_mb * 1e6:
            break
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "corpus.jsonl", "w") as f:
        for row in texts:
            f.write(json.dumps(row) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((row["text"] for row in texts), trainer)
    tok.save(str(args.out / "tokenizer.json"))
    with open(args.out / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}, f, indent=2)
    print(f"{len(texts)} documents, {size / 1e6:.2f} MB, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
