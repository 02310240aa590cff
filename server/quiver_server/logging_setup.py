"""Logging to stderr, either human-readable or one JSON object per line.

The launcher spawns shards with `--json-logs` and re-emits each line through its own logger, so
the JSON shape (`{"level", "message", "target"}`) is a contract with `quiver-launcher`.
"""

from __future__ import annotations

import json
import logging
import sys

PLAIN_FORMAT = "%(asctime)s %(levelname)-5s %(name)s: %(message)s"

# Third-party loggers that are chatty at INFO and say nothing an operator needs (boto's debug
# lines would also show request headers, a session token among them).
_QUIET_LOGGERS = ("httpx", "httpcore", "urllib3", "filelock", "botocore", "boto3", "s3transfer")


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record; a traceback, if any, is folded into `message`.

    Keeping every record on one line matters: the launcher splits the child's stderr on
    newlines, so a multi-line traceback must travel inside the JSON string.
    """

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        elif record.exc_text:
            message = f"{message}\n{record.exc_text}"
        payload = {"level": record.levelname, "message": message, "target": record.name}
        return json.dumps(payload, ensure_ascii=False)


def setup_logging(json_logs: bool = False, level: int | str = logging.INFO) -> None:
    """Routes all logging (ours, grpc's, huggingface_hub's, warnings) to one stderr handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLinesFormatter() if json_logs else logging.Formatter(PLAIN_FORMAT))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    _adopt_library_loggers()
    # warnings.warn(...) from transformers/torch would otherwise bypass the JSON formatter.
    logging.captureWarnings(True)


def _adopt_library_loggers() -> None:
    """Makes huggingface_hub log through our handler only.

    It attaches its own plain stderr handler to its top logger; left alone, its lines would
    break the JSON-lines stream and appear twice.
    """
    import huggingface_hub.utils.logging  # noqa: F401  (installs its handler, which we remove)

    hub_logger = logging.getLogger("huggingface_hub")
    for existing in list(hub_logger.handlers):
        hub_logger.removeHandler(existing)
    hub_logger.propagate = True


def adopt_transformers_logging(only_if_imported: bool = False) -> None:
    """Same for transformers, for code paths that use it (importing it takes seconds, and the
    shard's serving path does not need it, hence `only_if_imported`).

    transformers installs a plain stderr handler and stops propagation; undo both. Its progress
    bars ("Loading weights", "Writing model shards") are terminal drawings, not log lines; on a
    pipe they only garble the stream.
    """
    if only_if_imported and "transformers" not in sys.modules:
        return
    import transformers.utils.logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    transformers_logging.disable_progress_bar()
