"""The p2p tier's control plane attacked across two network namespaces (``tests/netns_pair.py``), so
that nothing rides on loopback: a relay that knows no secret, in one namespace at an address the
victim allows, relaying to the victim's own server across the veth (CASES C38); two readers in two
namespaces advertising one address, the second refused and the first reading on (C42). The same
attacks on loopback, and the relay this file shares, are tests/integration/test_p2p_attacks.py; an
instance inside a namespace is tests/netns/test_p2p_netns.py's ``NsInstance``.
"""

from __future__ import annotations

import pytest
import xxhash
from helpers import namespace, wait_until
from integration.test_p2p_attacks import Relay, assert_only_ciphertext, route
from integration.test_p2p_tier import PATIENCE_S, ROW, SECRET

from kvoffload.testing.tier_contract import keys_for, payload
from kvoffload.tools.ports import free_port


@pytest.mark.netns
def test_c38_a_relay_across_network_namespaces_gets_nothing(netns_pair):
    """The relay attack with nothing on loopback: V in namespace A, the relay in B at its veth
    address (which V allows), relaying to V's own server across the veth."""
    from netns.test_p2p_netns import NsInstance

    pair = netns_pair
    port = free_port()
    relay = Relay(pair.addr_b, f"{pair.addr_a}:{port}", pair=pair, side="b")
    v = NsInstance(
        pair,
        "a",
        {
            "type": "p2p",
            "host": pair.addr_a,
            "port": port,
            "transport": "tcp",
            "secret": SECRET,
            "allowed_peers": [relay.addr],
        },
        {},
    )
    try:
        keys = keys_for(4, seed=386)
        v.ok("store", keys=[k.hex() for k in keys])
        digests = v.ok("digest", keys=[k.hex() for k in keys])["digests"]
        asked = keys_for(2, seed=387)
        params = {"remote_kv_source": route(relay.addr)}
        reply = v.ok("resolve", keys=[k.hex() for k in asked], req_id="attack", params=params)
        assert reply["results"] == ["MISS", "MISS"]
        wait_until(
            lambda: v.ok("counters")["refused_messages"]["reflection"] or None,
            PATIENCE_S,
            "V's server to refuse its own Hello relayed back across the veth",
        )
        counters = v.ok("counters")
        assert counters["failed_handshakes"]["refused_reflection"] >= 1
        assert counters["authenticated"] == []
        stats = relay.stats()
        assert stats["connections"] >= 1
        assert_only_ciphertext(stats, v.addr.encode(), namespace(row_bytes=ROW).id().encode())
        assert v.ok("digest", keys=[k.hex() for k in keys])["digests"] == digests
        assert v.ok("state")["pinned"] == 0
    finally:
        v.stop()
        relay.stop()


@pytest.mark.netns
def test_c42_two_readers_in_two_namespaces_advertising_one_address(netns_pair):
    """The case's scenario: two readers in different network namespaces both advertise
    ``localhost:<same port>`` (a loopback advertise_host in front of an all-interfaces bind). The
    first reads 12 chunks from S; the second is refused ``identity_collision`` (counted at S and
    at the second); the first keeps reading all 12, its session never dropped."""
    from netns.test_p2p_netns import NsInstance

    pair = netns_pair
    s_port, r_port = free_port(), free_port()

    def reader() -> dict:
        return {
            "type": "p2p",
            "host": "0.0.0.0",
            "advertise_host": "localhost",
            "port": r_port,
            "peers": [f"{pair.addr_a}:{s_port}"],
            "transport": "tcp",
            "secret": SECRET,
        }

    serving = {
        "type": "p2p",
        "host": pair.addr_a,
        "port": s_port,
        "transport": "tcp",
        "secret": SECRET,
    }
    made = []
    try:
        s = NsInstance(pair, "a", serving, {})
        made.append(s)
        keys = keys_for(12, seed=422)
        s.ok("store", keys=[k.hex() for k in keys])
        r1 = NsInstance(pair, "a", reader(), {})
        made.append(r1)
        assert r1.addr == f"localhost:{r_port}"
        hexkeys = [k.hex() for k in keys]
        wait_until(lambda: r1.ok("state")["peers_up"] or None, PATIENCE_S, "R1's session")
        assert r1.ok("resolve", keys=hexkeys)["results"] == ["HIT"] * 12
        r2 = NsInstance(pair, "b", reader(), {})
        made.append(r2)
        assert r2.addr == r1.addr
        wait_until(
            lambda: r2.ok("counters")["failed_handshakes"]["refused_identity_collision"] or None,
            PATIENCE_S,
            "the second reader to be refused",
        )
        assert r2.ok("resolve", keys=hexkeys, req_id="r2")["results"] == ["MISS"] * 12
        counters = s.ok("counters")
        assert counters["refused_messages"]["identity_collision"] >= 1
        assert counters["server"]["restarts"] == 0
        r1.ok("drop", keys=hexkeys)
        assert r1.ok("resolve", keys=hexkeys, req_id="again")["results"] == ["HIT"] * 12
        want = [xxhash.xxh3_64_hexdigest(payload(k, ROW)) for k in keys]
        assert r1.ok("digest", keys=hexkeys)["digests"] == want
        assert r1.ok("counters")["failed_handshakes"]["refused_identity_collision"] == 0
        assert s.ok("counters")["server"]["restarts"] == 0
    finally:
        for inst in reversed(made):
            inst.stop()
