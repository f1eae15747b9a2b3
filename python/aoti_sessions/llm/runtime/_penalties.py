"""What a row's logits go through before they are sampled, besides the
temperature and the top-k / top-p / min-p filters (_sampling.py): its
``logit_bias`` and the repetition, frequency and presence penalties, in
that order (vLLM's), on the device for every row of a batch at once.

The penalties need each row's token counts; they stay on the device, in
:class:`Penalties`: one slot a generation that uses a penalty or a bias, a
row of each of its buffers (the counts of the tokens it generated, which of
the vocabulary it has seen, prompt included, and its bias), set when the
generation is first sampled and updated from each step's sampled tokens by
the device itself (the host never reads them), so a batch mixing rows with
and without them stays one sampler call.

- ``repetition_penalty`` (HF's and vLLM's): a token seen in the prompt or
  generated has its logit divided by the penalty where positive, multiplied
  where negative.
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI's): the logit of a
  token generated ``c`` times so far less ``c * frequency + presence`` (where
  ``c > 0``); the prompt does not count.
- ``logit_bias``: token id -> a bias added to its logit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Penalties"]

MIN_SLOTS = 8  # a buffer's rows at first (doubled as more generations use penalties at once)
MIN_BIASES = 8  # bias entries a slot holds at first (grown to the largest bias in use)


class Penalties:
    """The device state of the rows whose logits are biased or penalized:
    one slot a generation (:meth:`acquire`, :meth:`release`), on the
    device of the logits. Used by one thread (a step loop's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._vocab = 0
        self._capacity = 0
        self._free: list[int] = []
        self._counts: torch.Tensor | None = None  # [slots, V] float32: each token's count in what was generated
        self._seen: torch.Tensor | None = None    # [slots, V] bool: in the prompt or generated
        self._bias_ids: torch.Tensor | None = None     # [slots, M] int64 (padding: token 0, bias 0)
        self._bias_values: torch.Tensor | None = None  # [slots, M] float32
        self._biased: set[int] = set()  # slots whose bias is not all zero

    @property
    def in_use(self) -> int:
        """Slots held now."""
        return self._capacity - len(self._free)

    def acquire(self, vocab: int, prompt: Sequence[int], bias: Sequence[tuple[int, float]]) -> int:
        """A slot for a generation over a vocabulary of ``vocab`` tokens: no
        token generated yet, ``prompt``'s tokens seen, ``bias`` its logit
        bias (ids outside the vocabulary dropped: the LLM refuses them first)."""
        if self._counts is None or vocab != self._vocab:
            if self.in_use:
                raise ValueError(f"logits over {vocab} tokens where penalized rows have {self._vocab}")
            self._vocab, self._capacity, self._free = vocab, 0, []
            self._counts = self._seen = self._bias_ids = self._bias_values = None
        if not self._free:
            self._grow(max(MIN_SLOTS, 2 * self._capacity), self._biases())
        slot = self._free.pop()
        assert self._counts is not None and self._seen is not None
        self._counts[slot].zero_()
        seen = self._seen[slot]
        seen.zero_()
        cuda = self.device.type == "cuda"
        if prompt:
            seen.index_fill_(0, torch.tensor(prompt, dtype=torch.int64, pin_memory=cuda).to(self.device,
                                                                                           non_blocking=True), True)
        bias = [(t, b) for t, b in bias if 0 <= t < vocab and b]
        if bias or slot in self._biased:
            if len(bias) > self._biases():
                self._grow(self._capacity, max(MIN_BIASES, 1 << (len(bias) - 1).bit_length()))
            assert self._bias_ids is not None and self._bias_values is not None
            ids, values = self._bias_ids[slot], self._bias_values[slot]
            ids.zero_()
            values.zero_()
            if bias:
                self._biased.add(slot)
                ids[:len(bias)].copy_(torch.tensor([t for t, _ in bias], dtype=torch.int64, pin_memory=cuda),
                                      non_blocking=True)
                values[:len(bias)].copy_(torch.tensor([b for _, b in bias], dtype=torch.float32, pin_memory=cuda),
                                         non_blocking=True)
            else:
                self._biased.discard(slot)
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def _biases(self) -> int:
        return 0 if self._bias_ids is None else self._bias_ids.shape[1]

    def _grow(self, capacity: int, biases: int) -> None:
        """Buffers of ``capacity`` slots and ``biases`` entries a slot, what was there kept."""
        def grown(old: torch.Tensor | None, columns: int, dtype: torch.dtype) -> torch.Tensor:
            new = torch.zeros((capacity, columns), dtype=dtype, device=self.device)
            if old is not None:
                new[:old.shape[0], :old.shape[1]].copy_(old)
            return new

        self._counts = grown(self._counts, self._vocab, torch.float32)
        self._seen = grown(self._seen, self._vocab, torch.bool)
        if biases:
            self._bias_ids = grown(self._bias_ids, biases, torch.int64)
            self._bias_values = grown(self._bias_values, biases, torch.float32)
        self._free.extend(range(capacity - 1, self._capacity - 1, -1))
        self._capacity = capacity

    def adjusted(self, scores: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                 frequency: torch.Tensor, presence: torch.Tensor, temperature: torch.Tensor | None,
                 kinds: tuple[bool, bool]) -> torch.Tensor:
        """Rows ``rows`` of ``scores`` (``[P]`` indices; their generations'
        ``slots``) biased and penalized, as a new float32 ``[P, V]`` tensor.
        ``temperature`` (``[P]``): the scores are the logits divided by it,
        so the bias and the subtracted penalties are too (the repetition
        penalty's division keeps each sign: it commutes with the scaling);
        ``kinds``: whether any row has a repetition penalty, and whether any
        has a frequency or presence penalty (each a pass over [P, V] skipped
        where none has)."""
        sub = scores.index_select(0, rows).float()
        if self._biased:
            assert self._bias_ids is not None and self._bias_values is not None
            values = self._bias_values.index_select(0, slots)
            if temperature is not None:
                values = values.div_(temperature[:, None])
            sub.scatter_add_(1, self._bias_ids.index_select(0, slots), values)
        repeated, counted = kinds
        assert self._counts is not None and self._seen is not None
        if repeated:
            factor = repetition[:, None]
            sub = torch.where(self._seen.index_select(0, slots), torch.where(sub > 0, sub / factor, sub * factor), sub)
        if counted:
            counts = self._counts.index_select(0, slots)
            penalty = counts.mul(frequency[:, None]).add_((counts > 0) * presence[:, None])
            if temperature is not None:
                penalty.div_(temperature[:, None])
            sub.sub_(penalty)
        return sub

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each slot's generation sampled its token of ``tokens`` (``[P]``, on the device)."""
        assert self._counts is not None and self._seen is not None
        self._counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        self._seen.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.bool))
