"""SPECULATE / SPECULATOR_* : the flags (the launcher's and the shard's, defined once)
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


def _per_head(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None or not value.strip():
        return None
    try:
        counts = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if min(counts) < 1:
        raise click.BadParameter(f"every head keeps at least 1 token, got {value!r}")
    return counts


speculator_n_candidates_option = click.option(
    "--speculator-n-candidates",
    envvar="SPECULATOR_N_CANDIDATES",
    type=click.IntRange(min=1),
    default=None,
    help="MLP speculator: candidate chains tried per greedy row and step, the likeliest of its "
    "candidate tree; default: its config's n_candidates [env SPECULATOR_N_CANDIDATES].",
)
speculator_top_k_tokens_per_head_option = click.option(
    "--speculator-top-k-tokens-per-head",
    envvar="SPECULATOR_TOP_K_TOKENS_PER_HEAD",
    callback=_per_head,
    default=None,
    help="MLP speculator: top tokens each head adds to every chain of the candidate tree, comma-"
    "separated, one per head (e.g. 4,3,2); default: its config's top_k_tokens_per_head "
    "[env SPECULATOR_TOP_K_TOKENS_PER_HEAD].",
)
speculator_max_batch_size_option = click.option(
    "--speculator-max-batch-size",
    envvar="SPECULATOR_MAX_BATCH_SIZE",
    type=click.IntRange(min=1),
    default=DEFAULT_SPECULATOR_MAX_BATCH_SIZE,
    help="Steps with more decoding rows than this do not speculate [env SPECULATOR_MAX_BATCH_SIZE].",
)

SPECULATOR_BATCH_GATES = ("measured", "fixed")
speculator_batch_gate_option = click.option(
    "--speculator-batch-gate",
    envvar="SPECULATOR_BATCH_GATE",
    type=click.Choice(SPECULATOR_BATCH_GATES),
    default="measured",
    help="measured: the shard times a speculating step against a plain one at start-up, per number "
    "of decoding rows up to SPECULATOR_MAX_BATCH_SIZE (and MAX_BATCH_SIZE), and a step speculates "
    "only while its rows take more tokens per step than that costs; fixed: every step of at most "
    "SPECULATOR_MAX_BATCH_SIZE rows speculates [env SPECULATOR_BATCH_GATE].",
)


def refusal(
    speculate: int,
    max_batch_size: int,
    engine: str,
    speculator_name: str | None = None,
    world_size: int = 1,
    tree: bool = False,
) -> str | None:
    """Why SPECULATE=`speculate` / SPECULATOR_NAME cannot serve on `engine` with `world_size`
    shards (None: they can, or speculation is off). `tree`: SPECULATOR_N_CANDIDATES or
    SPECULATOR_TOP_K_TOKENS_PER_HEAD is set (they shape an MLP speculator's candidates)."""
    if speculate < 0:
        return f"SPECULATE must be >= 0, got {speculate}"
    if max_batch_size < 1:
        return f"SPECULATOR_MAX_BATCH_SIZE must be >= 1, got {max_batch_size}"
    if tree and not speculator_name:
        return (
            "SPECULATOR_N_CANDIDATES / SPECULATOR_TOP_K_TOKENS_PER_HEAD shape an MLP speculator's "
            "candidates: set SPECULATOR_NAME"
        )
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
