"""Router leases in the KV manager (the real class and its real ledger, in-process):
an owner that stops renewing loses its sequences' blocks after its lease; a live owner,
and a sequence no router owns, keep theirs. (tests/test_faults.py kills a real router.)"""
from __future__ import annotations

import asyncio

from specserve.deployments.kv_manager import KVManager, owned_seq_id


def test_an_expired_lease_frees_its_owners_blocks_and_only_them():
    async def scenario() -> tuple[dict, dict, int]:
        manager = KVManager(admission_timeout_s=1.0, lease_s=0.3)
        await manager.register_pool("replica-a", num_blocks=32, block_size=16)
        for seq_id in (owned_seq_id("dead", "1"), owned_seq_id("dead", "2"), owned_seq_id("alive", "1"), "plain"):
            await manager.admit(seq_id, 40)
        held = await manager.usage()
        for _ in range(5):  # "alive" renews, "dead" has stopped
            await asyncio.sleep(0.1)
            await manager.renew("alive")
        reclaimed = await manager.reap()
        return held, await manager.usage(), reclaimed

    held, after, reclaimed = asyncio.run(scenario())
    assert held["sequences"] == 4 and reclaimed == 2
    assert after["sequences"] == 2 and after["reclaimed"] == 2
    assert after["reserved_blocks"] == held["reserved_blocks"] // 2  # 3 blocks each


def test_a_router_unknown_to_a_restarted_manager_gets_a_lease_from_its_start():
    async def scenario() -> tuple[int, int]:
        manager = KVManager(lease_s=0.2)
        await manager.register_pool("replica-a", 8, 16, live={owned_seq_id("old", "1"): [0, 1]})
        early = await manager.reap()
        await asyncio.sleep(0.3)
        return early, await manager.reap()

    assert asyncio.run(scenario()) == (0, 1)
