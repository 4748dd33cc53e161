"""Text to token ids and back: byte-level, or a Hugging Face fast tokenizer (``tokenizer.json``).

Byte-level is dhelix's default (token = byte value, no end-of-text token; ``vocab`` ≥ 256).
With ``--tokenizer tokenizer.json`` the ``tokenizers`` package encodes each text document,
followed by the tokenizer's end-of-text id (the first of :data:`END_OF_TEXT` it has) so that
documents packed into one stream stay apart; generation decodes with the same file.
"""

from __future__ import annotations

import functools

from dhelix.dsl.core.errors import DhelixError

#: Names of the end-of-text token in common tokenizers, in the order they are looked for.
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
BYTE_VOCAB = 256


class TokenizerError(DhelixError):
    """A tokenizer file that cannot be used (unreadable, too many tokens for the model)."""


class ByteCodec:
    """Byte-level text: every UTF-8 byte is one token; there is no end-of-text token."""

    end_of_text: int | None = None
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """The text of ``ids`` (ids past a byte, and broken UTF-8, shown as U+FFFD)."""
        raw = b"".join(bytes((i,)) if i < BYTE_VOCAB else "\ufffd".encode() for i in ids)
        return raw.decode("utf-8", errors="replace")


class HFCodec:
    """A Hugging Face fast tokenizer read from its ``tokenizer.json``."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # the Rust library's errors are plain Exceptions
            raise TokenizerError(f"cannot read the tokenizer '{path}': {str(exc)[:200]}",
                                 notes=["give a Hugging Face fast tokenizer's tokenizer.json"]) from None
        self.path, self.vocab_size = path, self.tokenizer.get_vocab_size()
        self.end_of_text = next((i for name in END_OF_TEXT if (i := self.tokenizer.token_to_id(name)) is not None),
                                None)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """The text of ``ids``."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


@functools.lru_cache(maxsize=4)
def codec(path: str | None, vocab: int):
    """The codec of the tokenizer file ``path`` (None: byte-level) for a model of ``vocab``
    tokens; TokenizerError when the model has fewer tokens than the tokenizer makes."""
    found = ByteCodec() if path is None else HFCodec(path)
    if found.vocab_size > vocab:
        what = "byte-level text" if path is None else f"the tokenizer '{path}'"
        raise TokenizerError(f"{what} has {found.vocab_size} tokens, but the model's vocab is {vocab}",
                             notes=[f"set vocab = {found.vocab_size} or more in the model block"])
    return found
