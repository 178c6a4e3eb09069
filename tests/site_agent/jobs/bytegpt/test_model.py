"""The byte-level GPT: shapes, causality, determinism, the layer chain, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from site_agent.jobs.bytegpt.model import (
    Block,
    ByteGPT,
    Embedding,
    Head,
    ModelConfig,
    build_model,
    lm_loss,
    model_fingerprint,
)

torch.set_num_threads(1)

TINY = ModelConfig(context_len=16, num_layers=2, d_model=32, num_heads=4)


def _tokens(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq_len), generator=generator)


def test_forward_shapes() -> None:
    model = build_model(TINY, seed=0)
    logits = model(_tokens(3, 16))
    assert logits.shape == (3, 16, 256)
    assert logits.dtype == torch.float32
    # A shorter sequence than the context works too.
    assert model(_tokens(2, 5)).shape == (2, 5, 256)


def test_sequence_longer_than_context_is_rejected() -> None:
    model = build_model(TINY, seed=0)
    with pytest.raises(ValueError, match="context_len"):
        model(_tokens(1, 17))


def test_changing_a_future_token_leaves_earlier_logits_unchanged() -> None:
    model = build_model(TINY, seed=1)
    idx = _tokens(2, 16)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.equal(before[:, 10:], after[:, 10:])


def test_build_model_is_deterministic_per_seed() -> None:
    a = build_model(TINY, seed=7).state_dict()
    b = build_model(TINY, seed=7).state_dict()
    c = build_model(TINY, seed=8).state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["layers.0.token.weight"], c["layers.0.token.weight"])


def test_build_model_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_model(TINY, seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_init_follows_gpt2_scheme() -> None:
    cfg = ModelConfig(context_len=64, num_layers=4, d_model=128, num_heads=4)
    state = build_model(cfg, seed=0).state_dict()
    assert state["layers.1.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    assert state["layers.1.mlp_proj.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert state["layers.1.attn_proj.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.equal(state["layers.1.qkv.bias"], torch.zeros(3 * cfg.d_model))
    assert torch.equal(state["layers.5.ln.weight"], torch.ones(cfg.d_model))


def test_model_is_a_chain_whose_composition_is_forward() -> None:
    model = build_model(TINY, seed=2)
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [Embedding, Block, Block, Head]
    idx = _tokens(2, 12)
    x: torch.Tensor = idx
    with torch.no_grad():
        for layer in model.layers:
            x = layer(x)
        assert torch.equal(x, model(idx))


def test_layers_own_disjoint_parameters() -> None:
    model = build_model(TINY, seed=0)
    seen: set[int] = set()
    for layer in model.layers:
        ids = {id(p) for p in layer.parameters()}
        assert not ids & seen
        seen |= ids
    assert seen == {id(p) for p in model.parameters()}


def test_lm_loss_of_uniform_logits_is_log_vocab() -> None:
    logits = torch.zeros(2, 3, 256)
    targets = torch.randint(0, 256, (2, 3))
    assert lm_loss(logits, targets).item() == pytest.approx(math.log(256))


def test_fingerprint_changes_with_any_field() -> None:
    base = model_fingerprint(TINY)
    assert base == model_fingerprint(
        ModelConfig(context_len=16, num_layers=2, d_model=32, num_heads=4)
    )
    assert len(base) == 16 and int(base, 16) >= 0
    variants = [
        ModelConfig(context_len=32, num_layers=2, d_model=32, num_heads=4),
        ModelConfig(context_len=16, num_layers=3, d_model=32, num_heads=4),
        ModelConfig(context_len=16, num_layers=2, d_model=64, num_heads=4),
        ModelConfig(context_len=16, num_layers=2, d_model=32, num_heads=2),
        ModelConfig(context_len=16, num_layers=2, d_model=32, num_heads=4, mlp_ratio=2),
    ]
    assert len({model_fingerprint(v) for v in variants} | {base}) == len(variants) + 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 100, "num_heads": 3}, "model.d_model must be divisible by model.num_heads"),
        ({"num_layers": 0}, "model.num_layers"),
        ({"context_len": -1}, "model.context_len"),
        ({"vocab_size": 0}, "model.vocab_size"),
        ({"mlp_ratio": 0}, "model.mlp_ratio"),
        ({"num_heads": 0}, "model.num_heads"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        ModelConfig(256)  # type: ignore[call-arg]
    cfg = ModelConfig()
    with pytest.raises(AttributeError):
        cfg.d_model = 64  # type: ignore[misc]


def test_bytegpt_constructor_keeps_config() -> None:
    assert ByteGPT(TINY).cfg is TINY
