"""The Responses API answers this router keeps (RESPONSES_STORE_SIZE): the last N, in memory,
for `previous_response_id` and GET / DELETE /v1/responses/{id}.

A kept answer holds its Response object, its own input items and the id of the response it
continued; a conversation is read back by walking those ids. Nothing is shared between routers:
behind a load balancer a continuation must reach the replica that answered (session affinity),
else its previous response is not found. Answers are kept until N newer ones push them out,
deleted, or the router stops.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Kept:
    response: dict[str, Any]  # the Response object as answered
    input: list[dict[str, Any]]  # the call's own input items, each with an id
    previous: str | None  # the response it continued


class MissingResponse(LookupError):
    """A response of the conversation is not kept (never was, pushed out, or deleted)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    def __init__(self, size: int) -> None:
        self.size = size
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def keep(self, kept: Kept) -> None:
        self._kept[kept.response["id"]] = kept
        self._kept.move_to_end(kept.response["id"])
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> Kept | None:
        return self._kept.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The items of the conversation up to and with response `response_id`: each kept
        response's input items, then its output items, oldest first (MissingResponse where one
        is not kept)."""
        chain: list[Kept] = []
        at: str | None = response_id
        while at is not None:
            kept = self._kept.get(at)
            if kept is None or len(chain) > self.size:  # (a cycle cannot be made; bounded anyway)
                raise MissingResponse(at)
            chain.append(kept)
            at = kept.previous
        return [item for kept in reversed(chain) for item in (*kept.input, *kept.response["output"])]
