"""Log set-up for every pdserve process: text for people, JSON lines for log pipelines.

Each service writes one `request` line per finished request (`log_request`), carrying the request id and the
trace id, so a slow or failed request found in the logs leads straight to its trace.
"""

from __future__ import annotations

import json
import logging
import time

REQUEST_LOGGER = "pdserve.requests"


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.role,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s [{role}:%(process)d] %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        return line


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    text = str(value)
    return json.dumps(text) if (" " in text or not text) else text


def configure_logging(level: str, fmt: str, role: str) -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: use text or json")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else TextFormatter(role))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_request(logger: logging.Logger, **fields) -> None:
    """One line for one finished request."""
    logger.info("request", extra={"fields": fields})
