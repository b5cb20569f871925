"""A CLIP BPE tokenizer with a vocabulary cut to the words a small model actually saw.

The tiny CLIP keeps open_clip's tokenizer interface (``tok(texts) -> LongTensor[N, ctx]``)
and its BPE, but maps BPE ids onto a compact table: known tokens get their own id, any
other token (an LLM's unseen word) falls into one of a few hashed "unknown" buckets, so
every phrase still tokenises. EOT is the largest id, as open_clip's argmax pooling needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from open_clip.tokenizer import SimpleTokenizer

PAD_ID = 0
UNKNOWN_BUCKETS = 16


class CompactTokenizer:
    """open_clip-compatible tokenizer over a cut vocabulary (see module docstring)."""

    def __init__(self, kept_bpe_ids: Iterable[int], vocab_size: int, context_length: int):
        self.bpe = SimpleTokenizer()
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.sot_id = vocab_size - 2
        self.eot_id = vocab_size - 1
        kept = list(dict.fromkeys(int(i) for i in kept_bpe_ids))
        first = 1 + UNKNOWN_BUCKETS
        if first + len(kept) > self.sot_id:
            raise ValueError(f"{len(kept)} kept tokens do not fit a vocabulary of {vocab_size}")
        self.table = {bpe_id: first + i for i, bpe_id in enumerate(kept)}

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int, context_length: int) -> "CompactTokenizer":
        data = json.loads(Path(path).read_text())
        return cls(data["bpe_ids"], vocab_size, context_length)

    @staticmethod
    def kept_ids_for(texts: Iterable[str]) -> list[int]:
        """BPE ids that occur in ``texts``, in first-seen order: the vocabulary to keep."""
        bpe = SimpleTokenizer()
        seen: dict[int, None] = {}
        for text in texts:
            for token in bpe.encode(text):
                seen.setdefault(token, None)
        return list(seen)

    def _compact(self, bpe_id: int) -> int:
        return self.table.get(bpe_id, 1 + bpe_id % UNKNOWN_BUCKETS)

    def encode(self, text: str) -> list[int]:
        return [self._compact(t) for t in self.bpe.encode(text)]

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        ctx = context_length or self.context_length
        out = torch.full((len(texts), ctx), PAD_ID, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [self.sot_id] + self.encode(text)[: ctx - 2] + [self.eot_id]
            out[row, : len(ids)] = torch.tensor(ids)
        return out

    def is_known(self, word: str) -> bool:
        """True when every BPE piece of ``word`` has its own id (not an unknown bucket)."""
        return all(t in self.table for t in self.bpe.encode(word))
