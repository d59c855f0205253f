"""The router's generation core over a fake shard, wired as router/server.py wires it."""

from __future__ import annotations

from router.api.service import ConcurrencyLimiter, GenerationService
from router.core.batch_weights import BatchWeights
from router.core.capacity import WeightCapacity
from router.core.detokenizer import Detokenizer
from router.core.metrics import Metrics
from router.core.tokenizer import TokenizerPool
from router.core.validation import PrefixLengths, Validator
from router.scheduling.batcher import Batcher
from router.scheduling.request_queue import RequestQueue
from tests.router.fakes import EOS, FakeShard

MAX_SEQUENCE_LENGTH = 512


def service_over(
    shard: FakeShard,
    detokenizer: Detokenizer,
    tokenizer: TokenizerPool,
    *,
    max_batch_size: int,
    permits: int,
    max_new_tokens: int,
) -> tuple[GenerationService, Batcher]:
    """A GenerationService and the Batcher to run (`asyncio.create_task(batcher.run())`)."""
    metrics = Metrics(max_sequence_length=MAX_SEQUENCE_LENGTH, max_new_tokens=max_new_tokens)
    queue = RequestQueue(
        WeightCapacity(BatchWeights.from_model(shard.memory, True), 1.0), max_batch_size, metrics
    )
    batcher = Batcher(shard, queue, detokenizer, metrics, eos_token_id=EOS, max_waiting_tokens=2)
    validator = Validator(
        tokenizer,
        PrefixLengths(shard.prefix_lookup, metrics),
        metrics,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        max_new_tokens=max_new_tokens,
        vocab_size=tokenizer.tokenizer.get_vocab_size(with_added_tokens=True),
    )
    return GenerationService(validator, queue, ConcurrencyLimiter(permits), metrics), batcher
