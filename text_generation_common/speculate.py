"""SPECULATE / SPECULATOR_MAX_BATCH_SIZE: the flags (the launcher's and the shard's, defined once)
and their check against the engine; torch-free, so that the launcher refuses before any process
starts (text_generation_server/speculation/ serves them)."""

from __future__ import annotations

import click

from text_generation_common.engines import ENGINES

DEFAULT_SPECULATOR_MAX_BATCH_SIZE = 16

speculate_option = click.option(
    "--speculate",
    envvar="SPECULATE",
    type=click.IntRange(min=0),
    default=0,
    help="Speculative decoding (tgis_native): up to N candidate tokens per row and step, proposed "
    "by n-gram lookup in the prompt and output and verified in the step's forward; 0 = off [env SPECULATE].",
)
speculator_name_option = click.option(
    "--speculator-name",
    envvar="SPECULATOR_NAME",
    default=None,
    help="Speculative decoding (tgis_native) with IBM's MLP speculator (SPECULATE, where set, lowers "
    "its number of heads) or a draft model of the same tokenizer (SPECULATE candidates, default 4): a "
    "directory, or a hub id in the local cache [env SPECULATOR_NAME].",
)
speculator_revision_option = click.option(
    "--speculator-revision",
    envvar="SPECULATOR_REVISION",
    default=None,
    help="Revision of SPECULATOR_NAME in the hub cache [env SPECULATOR_REVISION].",
)
speculator_max_batch_size_option = click.option(
    "--speculator-max-batch-size",
    envvar="SPECULATOR_MAX_BATCH_SIZE",
    type=click.IntRange(min=1),
    default=DEFAULT_SPECULATOR_MAX_BATCH_SIZE,
    help="Steps with more decoding rows than this do not speculate [env SPECULATOR_MAX_BATCH_SIZE].",
)


def refusal(
    speculate: int,
    max_batch_size: int,
    engine: str,
    speculator_name: str | None = None,
    world_size: int = 1,
) -> str | None:
    """Why SPECULATE=`speculate` / SPECULATOR_NAME cannot serve on `engine` with `world_size`
    shards (None: they can, or speculation is off)."""
    if speculate < 0:
        return f"SPECULATE must be >= 0, got {speculate}"
    if max_batch_size < 1:
        return f"SPECULATOR_MAX_BATCH_SIZE must be >= 1, got {max_batch_size}"
    if not speculate and not speculator_name:
        return None
    asked = f"SPECULATOR_NAME={speculator_name}" if speculator_name else f"SPECULATE={speculate}"
    serving = [name for name, spec in ENGINES.items() if spec.capabilities.speculation]
    if engine not in serving:
        return f"{asked}: speculative decoding is served by {', '.join(serving)}, not {engine}"
    if speculator_name and world_size > 1:
        shards = f"{world_size} shards yet (NUM_SHARD=1; SPECULATE alone is)"
        return f"{asked}: a speculator model is not served on {shards}"
    return None
