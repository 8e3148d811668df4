"""Per-request sampling options. Validated once at admission so the step loop never has to."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.errors import InvalidInputError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean "no cut"; seed None draws from the engine's seed."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidInputError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidInputError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidInputError("top_k", f"must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidInputError("stop", "stop strings must be non-empty")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
