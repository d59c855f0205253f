"""Adapters added and removed while the server runs, as vLLM's LoRA routes do it: POST
/v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"} and POST
/v1/unload_lora_adapter {"lora_name"}, served only with ALLOW_RUNTIME_ADAPTER_LOADING (or
vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): the path is any directory the shards can read.

An adapter added under a name is loaded on every shard at once (a PEFT save: LoRA or prompt
tuning, as the store's), then served by that name wherever an adapter id is taken (the OpenAI
door's `model`, TGIS's `adapter_id`, TGI's `adapter_id`) and listed by /v1/models; it shadows a
store adapter of the same id. Removing it stops new requests naming it (running ones finish
with it). The answers are vLLM's: text `Success: LoRA adapter '<name>' added successfully.`,
and in OpenAI's error shape 400 for a name already added (`load_inplace` replaces it) or a
request without both fields, 404 for a path without an adapter or a name never added.
"""

from __future__ import annotations

import logging
from typing import Protocol

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from router.core.validation import PrefixLengths
from router.http.openai_api import OpenAIApi, error_reply
from router.scheduling.shard_client import ShardCallError
from text_generation_common.defaults import storable_adapter_id
from text_generation_common.logs import clip

logger = logging.getLogger(__name__)

STATUS = {"ALREADY_EXISTS": 400, "NOT_FOUND": 404, "INVALID_ARGUMENT": 400}


class Shards(Protocol):
    async def add_adapter(self, adapter_id: str, path: str, replace: bool = False) -> int: ...

    async def remove_adapter(self, adapter_id: str) -> None: ...


class LoadAdapter(BaseModel):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadAdapter(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM's, unused: names are the ids here


class AdapterAdmin:
    """The two routes, on the OpenAI door's router (so behind its authentication)."""

    def __init__(self, openai: OpenAIApi, shards: Shards, prefixes: PrefixLengths) -> None:
        self.openai, self.shards, self.prefixes = openai, shards, prefixes
        openai.router.add_api_route(
            "/load_lora_adapter", self.load, methods=["POST"], summary="Add an adapter by name (vLLM's)"
        )
        openai.router.add_api_route(
            "/unload_lora_adapter", self.unload, methods=["POST"], summary="Remove an added adapter (vLLM's)"
        )

    async def load(self, body: LoadAdapter, request: Request) -> Response:
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            return error_reply(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if not storable_adapter_id(name):
            return error_reply(400, f"lora_name {clip(name)!r} must be a path of alphanumeric, _ and - names")
        try:
            length = await self.shards.add_adapter(name, path, body.load_inplace)
        except ShardCallError as exc:
            return error_reply(STATUS.get(exc.status, 500), str(exc))
        self.prefixes.remember(name, length, adapter=True)
        self.openai.adapters_changed()
        logger.info("adapter %s added from %s", clip(name), clip(path))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: UnloadAdapter, request: Request) -> Response:
        name = body.lora_name
        if not name:
            return error_reply(400, "lora_name must be provided.")
        try:
            await self.shards.remove_adapter(name)
        except ShardCallError as exc:
            if exc.not_found:
                return error_reply(404, f"The lora adapter '{clip(name)}' cannot be found.")
            return error_reply(STATUS.get(exc.status, 500), str(exc))
        finally:
            self.prefixes.forget(name)
            self.openai.adapters_changed()
        logger.info("adapter %s removed", clip(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
