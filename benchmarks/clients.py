"""The two front-ends of the load generator: one request in, one RequestResult out.

GrpcClient    our API, fmaas.GenerationService/GenerateStream. Exact lengths: the prompt's text
              with `truncate_input_tokens = input_len` (a no-op on an exact prompt) and
              `min_new_tokens = max_new_tokens = output_len`, greedy. Message 1 carries only
              the input count; TTFT is the first message with generated tokens.
OpenAIClient  an OpenAI-compatible server (vLLM-CPU and other peers): streaming
              POST /v1/completions with `max_tokens = min_tokens = output_len`, `ignore_eos`,
              temperature 0, the prompt as text or as its token ids, and usage in the last
              chunk (`stream_options.include_usage`) for exact token counts.

Both time with time.perf_counter() when a message is read; failures become `error` strings
("CODE: details", "HTTP 500: ...") and never raise. `generate(prompt, first_token)` sets the
optional event when the first generated token arrives (or the request ends without one).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Protocol

import grpc
import httpx2

from benchmarks.stats import RequestResult
from benchmarks.workload import Prompt
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc

ERROR_CHARS = 300


class Client(Protocol):
    name: str

    async def generate(self, prompt: Prompt, first_token: asyncio.Event | None = None) -> RequestResult: ...

    async def close(self) -> None: ...


def _new_result(prompt: Prompt) -> RequestResult:
    return RequestResult(expected_input_len=prompt.input_len, expected_output_len=prompt.output_len)


def _finished(result: RequestResult) -> RequestResult:
    """Close `result` after its stream: no generated tokens is a failure, and a failed
    request ends when it failed."""
    if not result.error and result.messages == 0:
        result.error = "the stream ended without generated tokens"
    if result.error:
        result.end = time.perf_counter()
    return result


# --guided-json: an object whose string and array stay open as long as the model writes
# (EOS is masked until the output length, unless the JSON is complete)
GUIDED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}


class GrpcClient:
    name = "grpc"

    def __init__(
        self, address: str, timeout_s: float, adapter_ids: Sequence[str] = (), guided_json: bool = False
    ) -> None:
        """`adapter_ids`: requests name them in turn (none: the base model); `guided_json`:
        every request is constrained to GUIDED_SCHEMA (guided decoding)."""
        self.decoding = pb.DecodingParameters(json_schema=json.dumps(GUIDED_SCHEMA)) if guided_json else None
        self.address = address
        self.timeout_s = timeout_s
        self.adapter_ids = list(adapter_ids)
        self._sent = 0
        options = [("grpc.enable_http_proxy", 0), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.aio.insecure_channel(address, options=options)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    def request(self, prompt: Prompt) -> pb.SingleGenerationRequest:
        adapter = {"adapter_id": prompt.adapter_id} if prompt.adapter_id else {}
        if self.adapter_ids and not adapter:
            adapter = {"adapter_id": self.adapter_ids[self._sent % len(self.adapter_ids)]}
            self._sent += 1
        return pb.SingleGenerationRequest(
            **adapter,
            request=pb.GenerationRequest(text=prompt.text),
            params=pb.Parameters(
                method=pb.GREEDY,
                stopping=pb.StoppingCriteria(
                    max_new_tokens=prompt.output_len, min_new_tokens=prompt.output_len
                ),
                truncate_input_tokens=prompt.input_len,
                decoding=self.decoding,
            ),
        )

    async def generate(self, prompt: Prompt, first_token: asyncio.Event | None = None) -> RequestResult:
        result = _new_result(prompt)
        request = self.request(prompt)
        last = result.start = time.perf_counter()
        try:
            call = self.stub.GenerateStream(request, timeout=self.timeout_s)
            async for message in call:
                now = time.perf_counter()
                if message.input_token_count:
                    result.input_len = message.input_token_count
                if message.generated_token_count <= result.output_len:
                    continue  # the input-count message, or one with no new token
                if result.messages == 0:
                    result.ttft = now - result.start
                    if first_token is not None:
                        first_token.set()
                else:
                    result.itl.append(now - last)
                last = result.end = now
                result.messages += 1
                result.output_len = message.generated_token_count
        except grpc.aio.AioRpcError as exc:
            result.error = f"{exc.code().name}: {exc.details()}"[:ERROR_CHARS]
        if first_token is not None:
            first_token.set()
        return _finished(result)

    async def close(self) -> None:
        await self.channel.close()


class OpenAIClient:
    name = "openai"

    def __init__(
        self, base_url: str, model: str, timeout_s: float, prompt_as: str = "text", connections: int = 256
    ) -> None:
        if prompt_as not in ("text", "ids"):
            raise ValueError(f"prompt_as must be 'text' or 'ids', got {prompt_as!r}")
        self.model = model
        self.prompt_as = prompt_as
        limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.http = httpx2.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=httpx2.Timeout(timeout_s), limits=limits, trust_env=False
        )

    def body(self, prompt: Prompt) -> dict[str, object]:
        return {
            "model": self.model,
            "prompt": prompt.text if self.prompt_as == "text" else list(prompt.ids),
            "max_tokens": prompt.output_len,
            "min_tokens": prompt.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def generate(self, prompt: Prompt, first_token: asyncio.Event | None = None) -> RequestResult:
        try:
            return await self._generate(prompt, first_token)
        finally:
            if first_token is not None:
                first_token.set()

    async def _generate(self, prompt: Prompt, first_token: asyncio.Event | None) -> RequestResult:
        result = _new_result(prompt)
        body = self.body(prompt)
        last = result.start = time.perf_counter()
        chunks = 0
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text}"[:ERROR_CHARS]
                    result.end = time.perf_counter()
                    return result
                async for line in response.aiter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if chunk.get("choices"):
                        if result.messages == 0:
                            result.ttft = now - result.start
                            if first_token is not None:
                                first_token.set()
                        else:
                            result.itl.append(now - last)
                        last = result.end = now
                        result.messages += 1
                        chunks += 1
                    if usage := chunk.get("usage"):
                        result.input_len = int(usage.get("prompt_tokens") or 0)
                        result.output_len = int(usage.get("completion_tokens") or 0)
        except (httpx2.HTTPError, ValueError, OSError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        if not result.error and not result.output_len:  # no usage chunk: one token per chunk
            result.output_len = chunks
            result.input_len = result.input_len or prompt.input_len
        return _finished(result)

    async def close(self) -> None:
        await self.http.aclose()


async def served_model_name(base_url: str, timeout_s: float = 15.0) -> str:
    """The first model id an OpenAI-compatible server lists (GET /v1/models)."""
    async with httpx2.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, trust_env=False) as http:
        response = await http.get("/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
