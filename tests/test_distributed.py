"""What can be sharded is decided before any weight is read, with one line saying why not."""

from __future__ import annotations

import pytest
import transformers

from text_generation_server.config import ServerConfig
from text_generation_server.distributed import ShardingError, check_shardable


def llama(**overrides) -> transformers.LlamaConfig:
    fields = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000}
    return transformers.LlamaConfig(**{**fields, **overrides})


def test_families_with_a_plan_shard_when_their_heads_divide() -> None:
    check_shardable(llama(), 2)
    check_shardable(transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, vocab_size=2000), 2)
    check_shardable(llama(num_key_value_heads=3, num_attention_heads=3, hidden_size=48), 1)  # one shard
    with pytest.raises(ShardingError, match=r"^this model has 2 KV heads, which do not divide over 4 shards"):
        check_shardable(llama(), 4)
    with pytest.raises(ShardingError, match=r"^this model has 2001 vocabulary entries, which do not divide"):
        check_shardable(llama(vocab_size=2001), 2)


@pytest.mark.parametrize(
    "config",
    [transformers.BloomConfig(n_head=4), transformers.GPT2Config(n_head=4), transformers.T5Config()],
    ids=lambda c: c.model_type,
)
def test_families_without_a_plan_are_refused(config) -> None:
    with pytest.raises(ShardingError, match=rf"^{config.model_type} models cannot be sharded: .*gpt_bigcode"):
        check_shardable(config, 2)


def test_gpt_bigcode_shards_multi_query_models_whose_heads_divide() -> None:
    check_shardable(transformers.GPTBigCodeConfig(n_embd=64, n_head=4, multi_query=True), 2)
    with pytest.raises(ValueError, match=r"^multi-head GPT-BigCode models .* cannot be sharded"):
        check_shardable(transformers.GPTBigCodeConfig(n_embd=64, n_head=4, multi_query=False), 2)
    with pytest.raises(ValueError, match=r"^this model has 6 attention heads, which do not divide over 4"):
        check_shardable(transformers.GPTBigCodeConfig(n_embd=96, n_head=6, multi_query=True), 4)


def test_a_pinned_linear_layout_is_refused_for_sharded_models() -> None:
    ServerConfig("m", world_size=2, linear_layout="plain")
    with pytest.raises(ValueError, match=r"^LINEAR_LAYOUT=onednn lays out whole linears of one shard"):
        ServerConfig("m", world_size=2, linear_layout="onednn")
    with pytest.raises(ValueError, match="collective timeout must be > 0 s"):
        ServerConfig("m", collective_timeout_s=0)
