"""The configurations of our server that one run measures, one server start each.

A run can start our server several times: once per engine (`--engine hf_transformers,tgis_native`),
with and without prefix caching (`--prefix-cache both`), once per router prefill token budget
(`--prefill-budget 256,100000`), per adapter count and per SPECULATE (`--speculate 0,4`). Each
combination is a `ServerVariant`: the launcher arguments and environment that select it, and the
key its results are stored under, `ours` when the run has one variant, else `ours[...]` naming
only what varies (`ours[tgis_native]`, `ours[tgis_native,no-prefix-cache]`, `ours[budget=256]`,
`ours[speculate=4]`).

The engine-only baseline runs once per engine: its results are stored under `engine_only`, or
`engine_only[ENGINE]` when the run has several engines (`baseline_key`).

Torch-free: engine names and capabilities come from the registry in text_generation_common.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from text_generation_common.defaults import DEFAULT_DEPLOYMENT_FRAMEWORK
from text_generation_common.engines import ENGINES

PREFIX_CACHE_MODES = ("default", "on", "off", "both")
PREFIX_CACHING_ENV = "PREFIX_CACHING"  # the shard's switch; the launcher passes its env on
# Engines that cache prompt prefixes (the registry has no capability for it yet).
PREFIX_CACHE_ENGINES = frozenset({"tgis_native"})
OURS = "ours"
OURS_OPENAI = "ours-openai"  # our server again, through its OpenAI door with vLLM-CPU's client


@dataclass(frozen=True, slots=True)
class ServerVariant:
    """One configuration of our server: engine, prefix caching, prefill token budget, LoRA
    adapters the requests name (round robin)."""

    key: str  # "ours", or "ours[...]" naming what varies in this run
    engine: str
    prefix_cache: bool | None = None  # None: the server's default (on)
    prefill_budget: int | None = None  # --max-batch-prefill-tokens; None: the router's default
    adapters: int = 0  # LoRA adapters in the server's store; requests name them in turn
    speculate: int = 0  # --speculate: candidate tokens per row and step (0 = off)
    speculator: str = ""  # --speculator-name where speculate > 0 (else n-gram lookup)

    @property
    def adapter_ids(self) -> list[str]:
        return [adapter_id(i) for i in range(self.adapters)]

    def launcher_args(self) -> tuple[str, ...]:
        """Arguments the launcher gets for this variant (before the user's --server-arg)."""
        args: tuple[str, ...] = ("--deployment-framework", self.engine)
        if self.prefill_budget is not None:
            args += ("--max-batch-prefill-tokens", str(self.prefill_budget))
        if self.speculate:
            args += ("--speculate", str(self.speculate))
            if self.speculator:
                args += ("--speculator-name", self.speculator)
        return args

    def env(self) -> dict[str, str]:
        """Environment for this variant's server (the shards read PREFIX_CACHING)."""
        if self.prefix_cache is None:
            return {}
        return {PREFIX_CACHING_ENV: "true" if self.prefix_cache else "false"}

    def describe(self) -> dict[str, object]:
        """What the results record about this variant."""
        return {
            "engine": self.engine,
            "prefix_cache": "default" if self.prefix_cache is None else self.prefix_cache,
            "prefill_budget": "default" if self.prefill_budget is None else self.prefill_budget,
            "adapters": self.adapters,
            "speculate": self.speculate,
            "speculator": self.speculator if self.speculate else "",
        }


def adapter_id(index: int) -> str:
    return f"lora-{index}"


def parse_engines(text: str) -> tuple[str, ...]:
    """'hf_transformers,tgis_native' -> the names, each a registered engine, no duplicates."""
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not names:
        raise ValueError("expected at least one engine name")
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; choose from {', '.join(sorted(ENGINES))}")
    return names


def parse_budgets(text: str) -> tuple[int, ...]:
    """'256,100000' -> prefill token budgets (0 = no limit), no duplicates."""
    try:
        values = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        raise ValueError(f"expected comma-separated token counts, got {text!r}") from None
    if not values or min(values) < 0:
        raise ValueError(f"expected token counts >= 0, got {text!r}")
    return values


def caches_prefixes(engine: str) -> bool:
    capability = getattr(ENGINES[engine].capabilities, "prefix_caching", None)
    return bool(capability) if capability is not None else engine in PREFIX_CACHE_ENGINES


def plan_variants(
    engines: Sequence[str] = (DEFAULT_DEPLOYMENT_FRAMEWORK,),
    prefix_cache: str = "default",
    budgets: Sequence[int] = (),
    adapters: Sequence[int] = (),
    speculate: Sequence[int] = (),
    speculator: str = "",
) -> list[ServerVariant]:
    """Every combination of engine x prefix caching x budget x adapter count x SPECULATE, in that
    order. Prefix-cache settings apply to engines that cache prefixes, and speculation to engines
    that speculate; the others run once with their default. `speculator` (a directory) is the
    speculator model of the variants that speculate."""
    if prefix_cache not in PREFIX_CACHE_MODES:
        raise ValueError(f"prefix cache mode must be one of {', '.join(PREFIX_CACHE_MODES)}")
    settings: dict[str, tuple[bool | None, ...]] = {
        "default": (None,),
        "on": (True,),
        "off": (False,),
        "both": (True, False),
    }
    budget_choices: tuple[int | None, ...] = tuple(budgets) or (None,)
    adapter_choices = tuple(adapters) or (0,)
    speculate_choices = tuple(speculate) or (0,)
    combos = [
        (engine, cache, budget, count, lookahead)
        for engine in engines
        for cache in (settings[prefix_cache] if caches_prefixes(engine) else (None,))
        for budget in budget_choices
        for count in adapter_choices
        for lookahead in (speculate_choices if ENGINES[engine].capabilities.speculation else (0,))
    ]
    several_engines = len(set(engines)) > 1
    several_caches = len({c[1] for c in combos}) > 1
    several_budgets = len(budget_choices) > 1
    variants = []
    for engine, cache, budget, count, lookahead in combos:
        parts = []
        if several_engines:
            parts.append(engine)
        if several_caches and cache is not None:
            parts.append("prefix-cache" if cache else "no-prefix-cache")
        if several_budgets:
            parts.append(f"budget={budget}")
        if len(adapter_choices) > 1 or count:
            parts.append(f"adapters={count}")
        if len(speculate_choices) > 1 or lookahead:
            parts.append(f"speculate={lookahead}")
        key = f"{OURS}[{','.join(parts)}]" if parts else OURS
        variants.append(ServerVariant(key, engine, cache, budget, count, lookahead, speculator))
    return variants


def baseline_key(base: str, engine: str, engines: Sequence[str]) -> str:
    """`engine_only` when the run has one engine, else `engine_only[ENGINE]`."""
    return f"{base}[{engine}]" if len(set(engines)) > 1 else base


def split_key(key: str) -> tuple[str, str]:
    """'ours[tgis_native]' -> ('ours', 'tgis_native'); 'ours' -> ('ours', '')."""
    base, sep, rest = key.partition("[")
    return base, rest.removesuffix("]") if sep else ""
