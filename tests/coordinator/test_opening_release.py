"""A round's plans held back by ``Opening.release`` (a coordinator of several shards sends them
once every shard opened the round) go to each site where it is when they are sent: a site that
joined again on another connection in between gets its plan there."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from comm.codecs.floats import Fp32Codec
from comm.wire.schema import InitParams, RoundStart
from comm.wire.tensors import encode_tensors, state_hash
from tests.support.coordinator import PARAMS, Harness, join

pytestmark = pytest.mark.timeout(60)


def test_held_plans_go_to_the_connection_a_site_joined_again_on(harness: Harness) -> None:
    h = harness
    held: list[tuple[int, Callable[[], None]]] = []
    h.coord.opening.release = lambda round_id, send: held.append((round_id, send))
    eu, us = h.site("eu"), h.site("us")
    assert join(h, eu).need_init
    eu.send(
        InitParams(
            site_id="eu", model_fingerprint="fp", payload=encode_tensors(PARAMS, Fp32Codec())
        )
    )
    assert not join(h, us).need_init
    h.until(lambda: bool(held))
    (round_id, send), before = held[0], h.coord.membership["us"].peer
    # us joins again on a new connection before the plans go out.
    us.chan.close()
    again = h.site("us")
    join(h, again, version=0, digest=state_hash(PARAMS))
    assert h.coord.membership["us"].peer != before
    send()
    rs: RoundStart = h.expect(again, RoundStart)
    assert rs.round_id == round_id
    assert h.expect(eu, RoundStart).round_id == round_id
