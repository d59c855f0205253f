"""Logging setup shared by the launcher, the router and the shards: plain lines or JSON lines;
`clip` bounds the client strings that error messages and log lines echo; `first_line` is an
exception's reason on one line."""

from __future__ import annotations

import json
import logging
import sys
import time

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_ECHO_CHARS = 256  # a client string longer than this is shortened where it is echoed


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text`, or its first `limit` characters and how long it was, so that echoing a client's
    string can never make an error message or a log line large (gRPC clients refuse status
    messages over their 16 KiB metadata limit)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} characters)"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): a library's
    reason for an error line, without the traceback or report that may follow it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp, level, target (logger name), message, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, json_output: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The hub client's HTTP library logs every request at INFO.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
