"""The per-step post-processing every engine shares: from the logits of the last position of
each row to the step's output.

    logits [B, vocab] fp32 --NaN check--> failed rows (RequestError, TGIS's message)
                           --chooser.choose--> next ids [B], final scores
                           --token details--> TokenInfo per row (what each request asked for)
                           --chooser.advance--> sampling state moves on (every row)
    -> (next ids, StepOutput with a Generation per finite row and an error per NaN row)

An engine runs its forward pass, calls `choose_tokens`, feeds the next ids back into its batch
(`append_tokens` or its own equivalent), then `drop_failed` removes the rows that failed. Rows
are in batch order; the chooser and `requests` must be in that order too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from text_generation_common.messages import Generation, GenerationRequest, RequestError, StepOutput
from text_generation_server.batch import Batch
from text_generation_server.sampling.chooser import TokenChooser
from text_generation_server.sampling.token_details import generated_token_infos

NAN_LOGITS_MESSAGE = "Token decoding error: the model produced NaN logits"

B = TypeVar("B", bound=Batch)


def choose_tokens(
    logits: torch.Tensor, requests: Sequence[GenerationRequest], chooser: TokenChooser, forward_ns: int = 0
) -> tuple[torch.Tensor, StepOutput]:
    """Choose the next token of every row of `logits` [B, vocab] (float32, modified in place).

    Returns the next ids [B] (every row, failed ones included, so that the batch's tensors keep
    their shape until `drop_failed`) and the step's output.
    """
    nan = torch.isnan(logits.amax(dim=-1))  # amax propagates NaN; 15x cheaper than any()
    next_ids, scores = chooser.choose(logits)
    # NOTE: the step's one device-to-host copy (a sync on a GPU): the chosen ids and the NaN rows
    host = torch.cat((next_ids, nan.to(next_ids.dtype))).tolist()
    count = len(requests)
    next_list, nan_rows = host[:count], host[count:]
    infos = generated_token_infos(scores, next_list, [r.details for r in requests])
    chooser.advance(next_list, next_ids)
    output = StepOutput(forward_ns=forward_ns, guided_mask_ns=chooser.guided_ns)
    for request, info, nan in zip(requests, infos, nan_rows, strict=True):
        if nan:
            output.errors.append(RequestError(request.id, NAN_LOGITS_MESSAGE))
        else:
            output.generations.append(Generation(request.id, info))
    return next_ids, output


def drop_failed(batch: B, output: StepOutput) -> B | None:
    """`batch` without the requests that failed in `output` (None when none is left)."""
    if not output.errors:
        return batch
    return batch.prune({e.request_id for e in output.errors})
