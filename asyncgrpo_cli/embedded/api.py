"""The embedded server's leaf types: vLLM-shaped API errors and what request handling knows of the served model.

Every route module (completions, generate, lora, weight transfer) and the engine's callers import these; this
module imports nothing from the server, so none of them has to import another to raise an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ApiError(Exception):
    """An error answered as vLLM does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass
class ModelContext:
    """What request handling needs to know about the served model."""

    served_name: str
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20
    defaults: dict[str, Any] = field(default_factory=dict)
    """Sampling defaults from the model's generation_config.json (vLLM's ``--generation-config auto``)."""
    _token_strings: dict[int, str] = field(default_factory=dict)

    def token_string(self, token_id: int) -> str:
        s = self._token_strings.get(token_id)
        if s is None:
            s = self._token_strings[token_id] = self.tokenizer.decode([token_id])
        return s
