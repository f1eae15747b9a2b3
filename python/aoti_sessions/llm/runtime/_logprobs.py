"""Logprobs: the log-probability of each sampled token and of the most likely
tokens at its step, computed on the device for the rows of a batch that ask
for them, read by the host in the same copy as the sampled tokens.

They are ``log_softmax`` of the model's raw logits, before temperature,
penalties, ``logit_bias`` and the top-k / top-p / min-p filters (as OpenAI
reports them, and vLLM by default: ``logprobs_mode="raw_logprobs"``); a row
held to a grammar (structured output, required tool calls) has them of its
logits after the grammar's mask (tokens it forbids are -inf and never among
the top ones), as vLLM's too, whose masks are applied before its sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["TokenLogprob", "MAX_LOGPROBS", "StepLogprobs"]

MAX_LOGPROBS = 20  # top tokens a step at most (OpenAI's top_logprobs limit)


class TokenLogprob(NamedTuple):
    """One generated token's logprob, and the ``top`` tokens at its step:
    ``(token id, logprob)`` pairs, most likely first (as many as asked)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class StepLogprobs:
    """One step's logprobs, on the device: for batch rows ``rows`` (in
    order), each one's sampled token's logprob and its ``counts[i]`` top
    tokens (of the largest count's; the rest is cut when read)."""

    def __init__(self, rows: list[int], counts: list[int], chosen: torch.Tensor, top_ids: torch.Tensor,
                 top_values: torch.Tensor) -> None:
        self.rows, self.counts = rows, counts
        self.chosen, self.top_ids, self.top_values = chosen, top_ids, top_values

    @staticmethod
    def of(logits: torch.Tensor, rows: list[int], where: torch.Tensor | None, counts: list[int],
           tokens: torch.Tensor) -> StepLogprobs:
        """The logprobs of ``logits``' rows ``rows`` (``where``: the same
        indices on the device; None: every row, in order) for the sampled
        ``tokens`` (``[B]``, every row's)."""
        raw = logits if where is None else logits.index_select(0, where)
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        picked = tokens if where is None else tokens.index_select(0, where)
        chosen = logprobs.gather(1, picked[:, None]).squeeze(1)
        top = max(counts)
        if top:
            values, ids = torch.topk(logprobs, min(top, logprobs.shape[1]), dim=-1)
        else:
            values = ids = logprobs.new_empty((len(rows), 0))
        return StepLogprobs(rows, counts, chosen, ids.long(), values)

    def packed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` and these logprobs as one int64 tensor, for one copy to
        the host (the floats' bits kept exactly: :meth:`read`)."""
        bits = [t.contiguous().view(torch.int32).to(torch.int64).reshape(-1) for t in (self.chosen, self.top_values)]
        return torch.cat([tokens, bits[0], self.top_ids.reshape(-1), bits[1]])

    def read(self, host: torch.Tensor, tokens: Sequence[int]) -> dict[int, TokenLogprob]:
        """Each row's :class:`TokenLogprob` (by batch row) from ``host``,
        :meth:`packed`'s copy on the host (the step's ``tokens`` first)."""
        n, rows, width = len(tokens), len(self.rows), self.top_ids.shape[1]
        body = host[n:n + rows * (1 + 2 * width)]
        chosen = body[:rows].to(torch.int32).view(torch.float32).tolist()
        ids = body[rows:rows + rows * width].view(rows, width).tolist()
        values = body[rows + rows * width:].to(torch.int32).view(torch.float32).view(rows, width).tolist()
        return self._entries(tokens, chosen, ids, values)

    def here(self, tokens: Sequence[int]) -> dict[int, TokenLogprob]:
        """As :meth:`read`, from these tensors where they are on the host (the CPU)."""
        return self._entries(tokens, self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist())

    def _entries(self, tokens: Sequence[int], chosen: list[float], ids: list[list[int]],
                 values: list[list[float]]) -> dict[int, TokenLogprob]:
        return {row: TokenLogprob(tokens[row], chosen[i], tuple(zip(ids[i][:count], values[i][:count])))
                for i, (row, count) in enumerate(zip(self.rows, self.counts))}
