"""A site agent in-process under secure aggregation, talking to a recording link."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from comm.security.secagg import SecAggSession
from comm.transport.stats import ChannelStats
from comm.wire.schema import Message, RoundStart, Update
from site_agent.agent import SiteAgent
from site_agent.config import load_site_config
from site_agent.launch import build_job_trainer
from tests.conftest import write_site_config

pytestmark = pytest.mark.timeout(120)


class RecordingLink:
    """Stands in for the site's coordinator link: keeps what the agent sends."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.stats = ChannelStats(rtt_s=0.05, goodput_bps=1e8)

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def recv(self, timeout_s: float) -> Message | None:
        return None

    def close(self) -> None:
        pass


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
    assert cfg.secure_aggregation is not None
    link = RecordingLink()
    agent = SiteAgent(cfg, trainer=build_job_trainer(cfg), link=link)
    agent.start()
    agent.sender.open_session("s")
    stats = agent.trainer.train_steps(2)
    agent.sender.trained(1, stats.tokens)

    # A plan without the peers' keys cannot be masked: nothing goes out, nothing is recorded as
    # sent, and the tokens stay for the update that will carry this progress.
    agent._send_update(_round(1, {"attempt": 0}), stats)
    assert link.sent == []
    assert not agent.replica.in_flight and agent.sender.tokens_pending(0) == stats.tokens
    # Nothing is kept for a re-run of that round either.
    assert not agent.sender.send_again(_round(1, {"attempt": 1}), global_version=0)
    rejected = agent.metrics.registry.get_sample_value(
        "crossdc_site_rejected_total", {"site": "eu", "reason": "secagg_plan"}
    )
    assert rejected == 1.0

    # A usable plan (the other site's keys): the masked update goes out and is recorded.
    other = SecAggSession(site_id="us", session_id="s", config=cfg.secure_aggregation)
    mine = agent.sender.join_capabilities()["secagg_session_public"]
    peers = {"eu": [mine, ""], "us": [other.session_public.hex(), ""]}
    agent._send_update(_round(2, {"attempt": 0, "peers": peers}), stats)
    assert [type(m) for m in link.sent] == [Update]
    assert agent.replica.in_flight and agent.sender.tokens_pending(0) == 0
    assert agent.status()["rounds_sent"] == 1
