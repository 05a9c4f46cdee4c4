"""Server settings: listening address, auth, client-controlled size limits."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    """Everything about the HTTP front; the engine has its own ``EngineConfig``.

    Every size a client controls has a cap here, so one request can never
    hold the server hostage (body, headers, n, logprobs, stop strings, ...).
    """

    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 to serve the network
    port: int = 8000
    served_model_name: str | None = None  # defaults to the model's name
    api_key: str | None = None  # also read from $CARPOOL_API_KEY
    cors_origins: list[str] = field(default_factory=list)  # CORS is off when empty
    max_body_bytes: int = 4 * 2**20
    max_header_bytes: int = 16 * 2**10
    max_n: int = 16
    max_prompts: int = 32  # prompts in one /v1/completions batch
    max_messages: int = 256
    max_logprobs: int = 20
    max_stop: int = 16
    max_tokens_cap: int | None = None  # None: the context length is the only cap
    # Characters of prompt text in one request (all text prompts, or all chat
    # messages' content); None = no cap. Token-id prompts are not counted.
    max_prompt_chars: int | None = None
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    status_interval: float = 5.0  # seconds between status lines while busy
    stall_timeout: float = 120.0  # /health turns 503 if busy with no step for this long

    def validate(self) -> "ServerConfig":
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_body_bytes", "max_header_bytes", "max_n", "max_prompts",
                     "max_messages", "max_stop"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1 or null (no cap), "
                             f"got {self.max_prompt_chars}")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in [0, 20], got {self.max_logprobs}")
        if self.shutdown_timeout < 0 or self.status_interval <= 0 or self.stall_timeout <= 0:
            raise ValueError("shutdown_timeout must be >= 0, status_interval and "
                             "stall_timeout > 0")
        return self
