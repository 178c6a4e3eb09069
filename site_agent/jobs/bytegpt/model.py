"""The site-local model of the embedded default job: a small byte-level GPT.

The model is a plain chain of layers (``ByteGPT.layers``): an embedding, ``num_layers`` transformer
blocks and a head, each mapping one tensor to one tensor. That shape is what lets a site cut the
model into pipeline stages without knowing its internals, and why no weights are tied: every stage
must own a disjoint set of parameters.

The coordinator never sees this class; it holds named tensors. ``model_fingerprint`` (the job's
fingerprint, ``site_agent.jobs.contract``) is what a site shows it so that a site with a different
model is rejected.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from site_agent.jobs.bytegpt.model_config import ModelConfig as ModelConfig  # its home: no torch
from site_agent.jobs.contract import BYTEGPT_FACTORY, job_fingerprint, state_spec

INIT_STD = 0.02


class Embedding(nn.Module):
    """Token ids ``[B, T]`` to the residual stream ``[B, T, D]``: token plus learned position."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.context_len = cfg.context_len
        self.token = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position = nn.Embedding(cfg.context_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq_len = idx.shape[1]
        if seq_len > self.context_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds model.context_len={self.context_len}"
            )
        positions = torch.arange(seq_len, device=idx.device)
        embedded: torch.Tensor = self.token(idx) + self.position(positions)
        return embedded


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then a GELU MLP, both residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.attn_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp_fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.mlp_proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        head_dim = d_model // self.num_heads
        q, k, v = self.qkv(self.ln_attn(x)).split(d_model, dim=2)
        # [B, T, D] -> [B, H, T, D/H]
        q = q.view(batch, seq_len, self.num_heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, self.num_heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, self.num_heads, head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn = attn.transpose(1, 2).contiguous().view(batch, seq_len, d_model)
        x = x + self.attn_proj(attn)
        out: torch.Tensor = x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_mlp(x))))
        return out


class Head(nn.Module):
    """Residual stream ``[B, T, D]`` to logits ``[B, T, V]``: final LayerNorm and an untied linear."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.proj(self.ln(x))
        return logits


class ByteGPT(nn.Module):
    """A chain ``layers = [Embedding, Block * num_layers, Head]``; ``forward`` applies it in order."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(
            [Embedding(cfg), *(Block(cfg) for _ in range(cfg.num_layers)), Head(cfg)]
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.layers:
            x = layer(x)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over every token of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: ModelConfig, seed: int, *, device: str | torch.device = "cpu") -> ByteGPT:
    """A freshly initialised model; the same ``(cfg, seed)`` gives bit-identical parameters.

    Parameters are allocated without default initialisation and then drawn, on the CPU, from a
    private generator in ``named_parameters`` order, so the global torch RNG is left untouched and
    the values do not depend on ``device``. GPT-2 style: weights N(0, 0.02), biases zero, LayerNorm
    identity, and the two residual projections per block scaled by ``1/sqrt(2 * num_layers)``.
    """
    with torch.device("meta"):
        model = ByteGPT(cfg)
    model.to_empty(device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * cfg.num_layers)
    initialised: set[str] = set()
    with torch.no_grad():
        for module_name, module in model.named_modules():
            initialised.update(_draw(module_name, module, generator, residual_std))
    assert initialised == {name for name, _ in model.named_parameters()}
    assert not list(model.buffers()), "every state_dict entry must be a parameter"
    return model.to(device)


def _draw(
    module_name: str, module: nn.Module, generator: torch.Generator, residual_std: float
) -> set[str]:
    """Draw ``module``'s own parameters (GPT-2 style, see :func:`build_model`) from
    ``generator``; the names drawn (none for a module without parameters of its own)."""
    prefix = f"{module_name}." if module_name else ""
    if isinstance(module, nn.Linear):
        is_residual = module_name.endswith(("attn_proj", "mlp_proj"))
        std = residual_std if is_residual else INIT_STD
        nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
        nn.init.zeros_(module.bias)
        return {prefix + "weight", prefix + "bias"}
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD, generator=generator)
        return {prefix + "weight"}
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
        return {prefix + "weight", prefix + "bias"}
    return set()


def initial_parameters(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """θ0 of ``build_model(cfg, seed)`` as float32 arrays in ``state_dict`` order: what every
    site starts from, and what a coordinator builds instead of taking an upload."""
    model = build_model(cfg, seed)
    return {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}


def initial_tensors(cfg: ModelConfig, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """θ0 of ``build_model(cfg, seed)`` one tensor at a time, in ``state_dict`` order and bit
    for bit :func:`initial_parameters`'s (the same draws from the same generator), as float32
    arrays. Only the module being drawn is ever materialised, and its storage is released
    before the next one's is allocated, so a caller that keeps part of θ0 (a coordinator
    shard) holds its part and at most one more module's tensors, never the whole model."""
    with torch.device("meta"):
        model = ByteGPT(cfg)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * cfg.num_layers)
    expected = [name for name, _ in model.named_parameters()]
    given: list[str] = []
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not list(module.parameters(recurse=False)):
                continue
            module.to_empty(device="cpu", recurse=False)
            drawn = _draw(module_name, module, generator, residual_std)
            prefix = f"{module_name}." if module_name else ""
            own = [(prefix + n, p) for n, p in module.named_parameters(recurse=False)]
            assert drawn == {name for name, _ in own}, f"{module_name}: drawn {sorted(drawn)}"
            arrays = [(name, p.detach().numpy().copy()) for name, p in own]
            module.to_empty(device="meta", recurse=False)
            del own
            while arrays:
                name, value = arrays.pop(0)
                given.append(name)
                yield name, value
                del value
    assert given == expected, "every state_dict entry, in order"


def model_fingerprint(cfg: ModelConfig) -> str:
    """The byte GPT job's fingerprint at ``cfg``: the job factory and the names, shapes and dtypes
    of its state, as every site of a federation must show at its join."""
    with torch.device("meta"):
        model = ByteGPT(cfg)
    return job_fingerprint(BYTEGPT_FACTORY, state_spec(model), dataclasses.asdict(cfg))
