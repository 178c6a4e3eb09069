"""The byte GPT's shape, :class:`ModelConfig`, apart from the model (``model``): it imports no
torch, so that a coordinator can check ``[coordinator.initial_model.model]`` at its start without
loading the model's code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the byte-level GPT. Every site in a federation must use the same one."""

    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    context_len: int = 128
    """Longest sequence, in tokens, the position embedding covers."""
    num_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 128
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of each block's MLP as a multiple of ``d_model``."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "context_len",
            "num_layers",
            "d_model",
            "num_heads",
            "mlp_ratio",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"model.d_model must be divisible by model.num_heads, "
                f"got d_model={self.d_model} num_heads={self.num_heads}"
            )
