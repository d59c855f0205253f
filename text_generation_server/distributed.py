"""Tensor parallelism: the process group that joins a shard to its peers, and what it may shard.

With WORLD_SIZE > 1 every shard process holds 1/WORLD_SIZE of one model. `join` starts the
torch.distributed group before the model loads (gloo on CPU, NCCL on CUDA, rendezvous on
MASTER_ADDR:MASTER_PORT, every collective bounded by COLLECTIVE_TIMEOUT); transformers' own
tensor-parallel plans then split the weights as they are read (each rank reads only its slices
of the safetensors files), and the sharded linears all-reduce inside the forward pass. The
router sends every call to every rank in the same order (router/scheduling/shard_client.py), so all ranks
hold the same batches and block tables and choose the same tokens (sampling is always seeded);
rank 0 answers.

Which models shard is decided at load, by `check_shardable`: a family with a transformers
tensor-parallel plan whose attention heads, KV heads and vocabulary divide by the world size,
or multi-query GPT-BigCode on our own layers (engines/sharded_bigcode.py: the one KV head is
replicated on every rank).
A model that does not is refused before any weight is read, with one line saying why.

A failed step under tensor parallelism ends the shard (`StepFailure`): a peer that died or hung
fails the collective within the timeout, and a rank that failed alone no longer holds the same
state as the others. The launcher then stops the server with the reason.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Any, NoReturn

import torch

from text_generation_common.logs import first_line
from text_generation_server.config import ServerConfig

logger = logging.getLogger(__name__)

# Families our tests shard: those with a transformers tensor-parallel plan (other families with
# a plan shard too), and GPT-BigCode on our own layers; the rest are refused at load.
SHARDED_MODEL_TYPES = ("llama", "mistral", "granite", "qwen2", "gpt_neox", "gpt_bigcode")


class ShardingError(ValueError):
    """A model or device setup that cannot run over the configured number of shards."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join(config: ServerConfig) -> None:
    """Join the process group of the config's shards (no-op for one shard). On CUDA each rank
    takes the GPU of its number: fewer visible GPUs than shards is refused."""
    rank, world_size = config.rank, config.world_size
    if world_size == 1:
        return
    master_addr, master_port, timeout_s = config.master_addr, config.master_port, config.collective_timeout_s
    device = torch.device("cpu")
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if world_size > visible:
            raise ShardingError(
                f"{world_size} shards need {world_size} GPUs, but this process sees {visible} "
                "(CUDA_VISIBLE_DEVICES): set NUM_SHARD to the number of GPUs"
            )
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    backend = backend_for(device)
    logger.info(
        "shard %d/%d joining the %s group at %s:%d (collective timeout %gs)",
        rank,
        world_size,
        backend,
        master_addr,
        master_port,
        timeout_s,
    )
    try:
        torch.distributed.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, ValueError) as exc:  # the store's rendezvous timed out or failed
        raise ShardingError(
            f"shard {rank}/{world_size} could not join its peers at {master_addr}:{master_port}: "
            f"{first_line(exc)}"
        ) from None


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def leave() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def own_sharded_layers(hf_config: Any, shards: int) -> bool:
    """Whether the model, split over `shards` ranks, runs on our own sharded layers
    (engines/sharded_bigcode.py: GPT-BigCode, which has no transformers tensor-parallel plan)
    rather than transformers' plan: the loader, the adapters and this check ask here."""
    return shards > 1 and getattr(hf_config, "model_type", None) == "gpt_bigcode"


def check_shardable(hf_config: Any, shards: int) -> None:
    """Refuse, with one line, a model that cannot be split over `shards` ranks."""
    if shards == 1:
        return
    model_type = getattr(hf_config, "model_type", "?")
    if own_sharded_layers(hf_config, shards):
        from text_generation_server.engines import sharded_bigcode

        sharded_bigcode.check(hf_config, shards)
        return
    if not getattr(hf_config, "base_model_tp_plan", None):
        raise ShardingError(
            f"{model_type} models cannot be sharded: tensor parallelism (NUM_SHARD > 1) needs a "
            f"transformers tensor-parallel plan, which {', '.join(SHARDED_MODEL_TYPES)} (and other "
            f"families) have and {model_type} has not; run it on one shard (NUM_SHARD=1), or on "
            "DEPLOYMENT_FRAMEWORK=hf_accelerate to spread its layers over the GPUs"
        )
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for what, count in (
        ("attention heads", heads),
        ("KV heads", kv_heads),
        ("vocabulary entries", getattr(hf_config, "vocab_size", None)),
    ):
        if isinstance(count, int) and count % shards:
            raise ShardingError(
                f"this model has {count} {what}, which do not divide over {shards} shards: "
                "choose a NUM_SHARD that divides it"
            )


def agree_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (the same answer on every rank)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN)
    return int(tensor.item())


def agree_max(value: int, device: torch.device) -> int:
    """The largest of every rank's `value` (the same answer on every rank)."""
    return -agree_min(-value, device)


def local_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers this rank holds (its slices of sharded weights)."""
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def end_shard(rank: int, exc: BaseException) -> NoReturn:
    """A step failed while the ranks run one model: they can no longer be known to agree, so
    this shard stops at once (the launcher stops the others and reports the reason)."""
    logger.critical(
        "shard %d: a step failed under tensor parallelism, stopping (the ranks no longer agree): %s: %s",
        rank,
        type(exc).__name__,
        str(exc).splitlines()[0] if str(exc) else "",
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(1)
