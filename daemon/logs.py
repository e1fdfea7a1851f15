"""The daemon's log lines: one line per event (a traceback folded into it), with its level;
``--log-json``: one JSON object per line (``ts``, ``level``, ``logger``, ``msg``, ``exc``)."""

from __future__ import annotations

import json
import logging
import sys


class OneLine(logging.Formatter):
    """``2026-12-02 15:46:20,123 WARNING hicache.daemon message | Traceback ... | Error``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(as_json: bool = False, level: str = "INFO") -> None:
    """Log to stderr in one of the two formats (replaces any handler set before)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if as_json else OneLine())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
