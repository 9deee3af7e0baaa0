"""The interface every captioner implements, and helpers shared by decoding code.

Inputs (all batch-first):

* ``feats``  ``(B, N, D)`` float region features, zero-padded,
* ``mask``   ``(B, N)`` bool, True for real regions (padded regions must never be attended to),
* ``boxes``  ``(B, N, 4)`` float pixel boxes ``x1, y1, x2, y2`` (the geometry input),
* ``sizes``  ``(B, 2)`` float image ``width, height`` in pixels.

Captions are id tensors using :mod:`pipeline.core.vocab`'s specials (``PAD=0, BOS=1, EOS=2``).

Teacher forcing: ``forward(...)`` encodes each image **once** and decodes all its captions:
``captions`` is ``(C, T)`` starting with BOS and ``caption_image`` ``(C,)`` maps each caption to its image.
It returns log-probabilities ``(C, T, V)`` for the next token at every position.

Incremental decoding (beam search, sampling): ``encode`` returns an encoder state, ``init_state`` a
decoder state, and ``step`` consumes one token per row and returns ``(C, V)`` log-probabilities and the
new state. States are nested dicts/tuples/lists of batch-first tensors, so :func:`index_state` can
expand them to beams and reorder them without knowing the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

State = Any  # nested dict/tuple/list of tensors with the batch (row) dimension first


def index_state(state: State, index: torch.Tensor) -> State:
    """Select rows ``index`` along dim 0 of every tensor in a nested state (expand, reorder, prune beams)."""
    if torch.is_tensor(state):
        return state.index_select(0, index)
    if isinstance(state, dict):
        return {k: index_state(v, index) for k, v in state.items()}
    if isinstance(state, tuple):
        return tuple(index_state(v, index) for v in state)
    if isinstance(state, list):
        return [index_state(v, index) for v in state]
    return state


def cat_states(first: State, second: State) -> State:
    """Concatenate two nested states of the same structure along dim 0 (the rows of ``first``, then ``second``'s)."""
    if torch.is_tensor(first):
        return torch.cat([first, second])
    if isinstance(first, dict):
        return {k: cat_states(v, second[k]) for k, v in first.items()}
    if isinstance(first, (tuple, list)):
        return type(first)(cat_states(a, b) for a, b in zip(first, second, strict=True))
    return first


def first_tensor(state: State) -> torch.Tensor:
    """The first tensor of a nested state (depth first), or None."""
    if torch.is_tensor(state):
        return state
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for v in values:
        found = first_tensor(v)
        if found is not None:
            return found
    return None  # type: ignore[return-value]


def state_rows(enc: State) -> int:
    """Rows of a nested state (dim 0 of its first tensor)."""
    t = first_tensor(enc)
    if t is None:
        raise ValueError("encoder state holds no tensor")
    return int(t.shape[0])


def state_device(enc: State) -> torch.device:
    """Device of a nested state's first tensor."""
    return first_tensor(enc).device


class Captioner(nn.Module, ABC):
    """Base class of all captioners (see the module docstring for the tensor contract)."""

    #: registry name, set by :func:`models.register_captioner`
    name: str = ""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def max_caption_len(self) -> int | None:
        """The most tokens (``<eos>`` included) the model can generate: the size of its position table, or None
        when it has none (recurrent models). Decoding options are checked against it before any work."""
        return None

    @abstractmethod
    def encode(self, feats: torch.Tensor, mask: torch.Tensor, boxes: torch.Tensor, sizes: torch.Tensor) -> State:
        """Encode the regions of each image; the result is indexable by image along dim 0."""

    @abstractmethod
    def init_state(self, enc: State) -> State:
        """A fresh decoder state for every row of ``enc`` (nothing generated yet)."""

    @abstractmethod
    def step(self, tokens: torch.Tensor, enc: State, state: State) -> tuple[torch.Tensor, State]:
        """Consume ``tokens`` ``(C,)`` (the previous word, BOS first) and return ``(C, V)`` log-probs and the new
        state."""

    @abstractmethod
    def decode_teacher_forced(self, enc: State, captions: torch.Tensor) -> torch.Tensor:
        """Log-probs ``(C, T, V)`` for ``captions`` ``(C, T)`` given ``enc`` already expanded to ``C`` rows."""

    def forward(
        self,
        feats: torch.Tensor,
        mask: torch.Tensor,
        boxes: torch.Tensor,
        sizes: torch.Tensor,
        captions: torch.Tensor,
        caption_image: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher forcing: encode each image once, decode all its captions (see module docstring)."""
        enc = self.encode(feats, mask, boxes, sizes)
        if caption_image is not None:
            enc = index_state(enc, caption_image.to(feats.device))
        return self.decode_teacher_forced(enc, captions)
