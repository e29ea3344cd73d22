"""Structured logging for the launcher and server: `key=value` lines (default) or one JSON object a line.

Attach fields with `log.info("request done", extra={"fields": {"id": rid, "status": 200}})`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = {"fields"}


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        v = round(v, 4)
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    if s == "" or any(c in s for c in ' ="\n'):
        return json.dumps(s)
    return s


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        parts = [f"ts={ts}", f"level={record.levelname.lower()}", f"logger={record.name}",
                 f"msg={_fmt_value(record.getMessage())}"]
        for k, v in (getattr(record, "fields", None) or {}).items():
            parts.append(f"{k}={_fmt_value(v)}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", json_format: bool = False, stream: Any = None) -> None:
    """Route the root logger (ssd, uvicorn, ray client) through one formatter on stderr."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_format else KeyValueFormatter())
    handler._ssd = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_ssd", False) or type(h) is logging.StreamHandler:  # ours, or basicConfig's
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers = []
        lg.propagate = True
