"""HF ``tokenizers`` wrapper: a tokenizer.json (or a folder holding one), or GPT-2's byte-level
BPE from a vocab.json and merges.txt pair (Megatron-LM's --vocab-file and --merge-file), with
BOS/EOS."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from dtrain.assets import resolve
from dtrain.config import ConfigError


class Tokenizer:
    """Encodes text to token ids. BOS/EOS come from tokenizer_config.json beside the file
    (``bos_token``/``eos_token``) unless given."""

    def __init__(self, path: str | Path, bos: str | None = None, eos: str | None = None,
                 merges: str | Path | None = None):
        value, path = str(path), resolve(str(path))
        if merges is None and path.is_dir() and not (path / "tokenizer.json").is_file() \
                and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            path, merges = path / "vocab.json", path / "merges.txt"
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file {file} not found: set data.tokenizer to a "
                                    "tokenizer.json or a folder holding one")
        self._tok = _gpt2_bpe(file, Path(merges)) if merges is not None else _from_file(file,
                                                                                        value)
        stat = file.stat()
        self.file_key = (str(file), stat.st_mtime_ns, stat.st_size)  # identifies the vocabulary
        special = {}
        config = file.parent / "tokenizer_config.json"
        if config.is_file():
            special = json.loads(config.read_text())
        elif merges is not None and self._tok.token_to_id(GPT2_EOS) is not None:
            special = {"eos_token": GPT2_EOS}
        self.bos_id = self._token_id(bos or _content(special.get("bos_token")), "bos")
        self.eos_id = self._token_id(eos or _content(special.get("eos_token")), "eos")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The ``tokenizers.Tokenizer`` underneath (for saving it as a tokenizer.json)."""
        return self._tok

    def _token_id(self, token: str | None, which: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"{which} token {token!r} is not in the tokenizer's vocabulary: set "
                             f"data.{which}_token to one of its special tokens")
        return token_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + (
            [self.eos_id] if eos and self.eos_id is not None else [])

    def encode_batch(self, texts: list[str], bos: bool = False, eos: bool = False
                     ) -> list[list[int]]:
        out = self._tok.encode_batch(texts, add_special_tokens=False)
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return [head + e.ids + tail for e in out]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


GPT2_EOS = "<|endoftext|>"


def _from_file(file: Path, value: str) -> HFTokenizer:
    """A tokenizer.json; ConfigError naming ``data.tokenizer`` where it is not one."""
    try:
        return HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for any file it cannot read
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        name = f"data.tokenizer = {value!r}" + ("" if str(file) == value else f": {file}")
        raise ConfigError(f"{name} is not a HF tokenizer.json ({reason}): set data.tokenizer "
                          "to a tokenizer.json saved by HF tokenizers, or a folder holding one, "
                          "or a GPT-2 vocab.json with data.merge_file") from None


def _gpt2_bpe(vocab: Path, merges: Path) -> HFTokenizer:
    """GPT-2's byte-level BPE from its vocab.json and merges.txt (Megatron-LM's GPT2BPETokenizer:
    the same pre-tokenization, merges and ids as GPT-2's tokenizer.json), ``<|endoftext|>`` a
    special token where the vocabulary has it."""
    from tokenizers import decoders, models, pre_tokenizers

    if not merges.is_file():
        raise ConfigError(f"data.merge_file = {str(merges)!r} not found: give GPT-2's "
                          "merges.txt")
    try:
        tok = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:  # a bare Exception, as above
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"data.tokenizer = {str(vocab)!r} with data.merge_file = "
                          f"{str(merges)!r} is not a GPT-2 vocab.json and merges.txt pair "
                          f"({reason})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(GPT2_EOS) is not None:
        tok.add_special_tokens([GPT2_EOS])
    return tok


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``multiple`` (Megatron's
    make-vocab-size-divisible-by x tensor-parallel degree)."""
    return -(-vocab_size // multiple) * multiple


def _content(token: str | dict | None) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token
