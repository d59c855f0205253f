"""Batch weights: how much memory a set of requests needs, in the shard's units (TGIS formulas).

A request counts as (in, out): running ones in = input + prefix + generated, out = tokens it may
still generate; queued ones in = input + prefix, out = max_new_tokens. The shard reports the
coefficients and the limit (proto/generate.proto MemoryScalingModel). Two layouts:

| quantity        | padded (max_in, max_out, total_in over bs)         | unpadded (total_in, total_out) |
|-----------------|-----------------------------------------------------|--------------------------------|
| max weight      | (max_in + max_out) * bs * g                         | (total_in + total_out) * g     |
| initial weight  | max_in * bs * g                                     | total_in * g                   |
| prefill weight  | max(bs*max_in*lin, bs*max_in*q1 + bs*max_in^2*q2)   | total_in * g_pf                |
| padding         | (max_in * bs - total_in) / (max_in * bs)            | 0                              |

`exceeds` is the exact peak check: the weight of a batch peaks when a request finishes, so walk
the requests by remaining output, longest first: when the k-th longest finishes, the k requests
still resident have all grown by its output length. Callers: request_queue.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from text_generation_common.messages import MemoryScalingModel

Load = tuple[int, int]  # (in, out) tokens of one request


@dataclass(frozen=True, slots=True)
class BatchWeights:
    padded: bool
    linear: float  # prefill per token (padded: lin; unpadded: g_pf)
    quadratic0: float
    quadratic1: float
    per_token: float  # g
    limit: int

    @classmethod
    def from_model(cls, m: MemoryScalingModel, padded: bool) -> BatchWeights:
        per_token = (
            max(m.nexttoken_linear_coef0, m.nexttoken_linear_coef1) if padded else m.nexttoken_linear_coef1
        )
        return cls(
            padded=padded,
            linear=m.prefill_linear_coef0,
            quadratic0=m.prefill_quadratic_coef0,
            quadratic1=m.prefill_quadratic_coef1,
            per_token=per_token,
            limit=m.weight_limit,
        )

    def max_weight(self, loads: Sequence[Load]) -> int:
        if not loads:
            return 0
        if self.padded:
            return math.floor(
                (max(i for i, _ in loads) + max(o for _, o in loads)) * len(loads) * self.per_token
            )
        return math.floor(sum(i + o for i, o in loads) * self.per_token)

    def initial_weight(self, loads: Sequence[Load]) -> int:
        return math.floor(self.batch_tokens(loads) * self.per_token)

    def prefill_weight(self, loads: Sequence[Load]) -> int:
        if not loads:
            return 0
        if not self.padded:
            return math.floor(sum(i for i, _ in loads) * self.linear)
        size, longest = len(loads), max(i for i, _ in loads)
        linear = size * longest * self.linear
        quadratic = size * longest * self.quadratic0 + size * longest**2 * self.quadratic1
        return math.floor(max(linear, quadratic))

    def padding_fraction(self, loads: Sequence[Load]) -> float:
        if not loads or not self.padded:
            return 0.0
        area = self.batch_tokens(loads)
        return (area - sum(i for i, _ in loads)) / area if area else 0.0

    def batch_tokens(self, loads: Sequence[Load]) -> int:
        """Prompt positions a prefill of `loads` computes (padded: every row as long as the longest)."""
        if not loads:
            return 0
        return max(i for i, _ in loads) * len(loads) if self.padded else sum(i for i, _ in loads)

    def exceeds(self, loads: Sequence[Load], candidate: Load) -> bool:
        """Would `loads` + `candidate` ever weigh more than the limit before all finish?"""
        everything = sorted([*loads, candidate], key=lambda load: (load[1], load[0]), reverse=True)
        cand_out = candidate[1]
        longest_in = total_in = 0
        for position, (i, o) in enumerate(everything):
            longest_in = max(longest_in, i)
            total_in += i
            if o > cand_out:
                continue  # finishes after the candidate: adding it changes nothing here
            resident = position + 1
            if self.padded:
                weight = (longest_in + o) * resident * self.per_token
            else:
                weight = (total_in + resident * o) * self.per_token
            if weight > self.limit:
                return True
        return False
