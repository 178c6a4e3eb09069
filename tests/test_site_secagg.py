"""A site agent in-process under secure aggregation, talking to a recording link."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from comm.security.secagg import SecAggSession
from comm.wire.schema import Message, RoundStart, Update
from site_agent.config import load_site_config
from site_agent.launch import build_agent
from tests.conftest import write_site_config

pytestmark = pytest.mark.timeout(120)


class RecordingLink:
    """Stands in for the site's coordinator link: keeps what the agent sends."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.stats = SimpleNamespace(rtt_s=0.05, goodput_bps=1e8, bytes_sent=0, bytes_received=0)

    def send(self, msg: Message) -> None:
        self.sent.append(msg)


def _round(round_id: int, secagg: dict[str, Any]) -> RoundStart:
    return RoundStart(
        round_id=round_id,
        global_version=0,
        fragment_base_version=0,
        fragment=0,
        num_fragments=1,
        num_inner_steps=2,
        overlap=True,
        codec="secagg",
        deadline_s=60.0,
        participants=("eu", "us"),
        evaluate=False,
        reason="test",
        secagg=secagg,
    )


def test_a_site_that_cannot_mask_keeps_its_progress_for_the_next_update(tmp_path: Path) -> None:
    cfg = load_site_config(
        write_site_config(tmp_path, "eu", 0, 2, secure_aggregation={"clip_bound": 64.0})
    )
    agent = build_agent(cfg)
    (tmp_path / "site-eu").mkdir()  # what start() would create
    assert cfg.secure_aggregation is not None
    link = RecordingLink()
    agent.link = link  # type: ignore[assignment]
    agent.secagg = SecAggSession(site_id="eu", session_id="s", config=cfg.secure_aggregation)
    stats = agent.trainer.train_steps(2)
    agent._tokens[0] = stats.tokens

    # A plan without the peers' keys cannot be masked: nothing goes out, nothing is recorded as
    # sent, and the tokens stay for the update that will carry this progress.
    agent._send_update(_round(1, {"attempt": 0}), stats)
    assert link.sent == []
    assert agent._sent == {} and agent._tokens == {0: stats.tokens}
    assert agent._unmasked == {}
    rejected = agent.metrics.registry.get_sample_value(
        "crossdc_site_rejected_total", {"site": "eu", "reason": "secagg_plan"}
    )
    assert rejected == 1.0

    # A usable plan (the other site's keys): the masked update goes out and is recorded.
    other = SecAggSession(site_id="us", session_id="s", config=cfg.secure_aggregation)
    peers = {
        site: [session.session_public.hex(), ""]
        for site, session in (("eu", agent.secagg), ("us", other))
    }
    agent._send_update(_round(2, {"attempt": 0, "peers": peers}), stats)
    assert [type(m) for m in link.sent] == [Update]
    assert set(agent._sent) == {0} and agent._tokens == {}
