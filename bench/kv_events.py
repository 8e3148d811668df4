"""What a KV event subscription and the ZMQ publisher cost the front end, at cache sizes a replica holds.

For a mirror of N published blocks (a quarter of them with an image/frame as extra keys), per
SubscribeKvEvents snapshot:

- before: the snapshot converted to protobuf and serialized on the event loop, what every subscribe
  cost until #42 on top of walking the mirror into that snapshot (a lower bound: the walk is gone);
- now, on the event loop: the hub's snapshot when the cache changed since the last one (a tuple of
  the mirror's blocks; unchanged, it is the same object: free);
- now, on a worker thread: the serialized snapshot from per-block events serialized once (warm: every
  block seen before; cold: every block new, the first subscription after a start).

And the ZMQ publisher's encoding (vLLM's msgpack layout), the work its thread does per batch: of a
step's batch (4 blocks stored), and of a snapshot, three ways: before, every event encoded again
(`encode_batch`, what the thread ran for every snapshot until the SnapshotEncoder); now, each
block's event encoded once while it stays cached (SnapshotEncoder): warm (every block encoded
for an earlier snapshot), a tenth of the blocks new since the last snapshot, cold (every block new:
the first snapshot). An unchanged cache snapshotted again (an idle pod) is the same snapshot object
and costs a look-up.

    python bench/kv_events.py [--blocks 1000 13000 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path

from serving import machine

from mmserve.engine.kv_event_hub import Cleared, KvBatch, KvEventHub, Stored
from mmserve.ipc.kv_cache_events import BlockStored, EventsStarted
from mmserve.server.kv_event_publisher import SnapshotEncoder, encode_batch
from mmserve.server.vllm_engine.kv_events import SnapshotSerializer, batch_message

BLOCK = 16
RESULTS = Path(__file__).parent / "results" / "kv_events.json"


def mirror(n: int, rng: random.Random) -> KvEventHub:
    """A hub mirroring n blocks in chains of 100 (a quarter with a frame in them)."""
    hub = KvEventHub(BLOCK, 10**9)

    async def fill():
        sub = hub.subscribe()
        first = asyncio.ensure_future(sub.__anext__())
        await asyncio.sleep(0)
        events, parent = [EventsStarted()], None
        for j in range(n):
            key = rng.randbytes(32)
            extra = ((rng.randbytes(32).hex(), rng.randint(-8, 8)),) if j % 4 == 0 else None
            events.append(BlockStored(key, parent if j % 100 else None, j % 100,
                                      tuple(rng.randrange(262144) for _ in range(BLOCK)), "r", extra))
            parent = key
        hub.apply(events)
        await first
        await sub.aclose()

    asyncio.run(fill())
    return hub


def timed(fn, repeat: int, setup=lambda: None) -> float:
    """Median milliseconds of `fn(setup())`, or of `fn()` when there is no setup (not timed)."""
    times = []
    for _ in range(repeat):
        state = setup()
        t = time.perf_counter()
        fn() if state is None else fn(state)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def zmq_snapshots(snapshot: KvBatch, rng: random.Random, repeat: int) -> dict:
    """SnapshotEncoder's snapshot warm, with a tenth of its blocks new, and cold (each a fresh
    snapshot object, as after any change of the cache), against encode_batch's."""
    stores = snapshot.ops[1:]
    again = KvBatch(snapshot.sequence + 1, time.time(), snapshot.ops, snapshot=True)
    new = {rng.randrange(len(stores)) for _ in range(len(stores) // 10)}
    tenth = KvBatch(snapshot.sequence + 1, time.time(),
                    (Cleared(), *(Stored(rng.getrandbits(63), op.parent, op.token_ids, op.extra_keys) if i in new else op
                                  for i, op in enumerate(stores))), snapshot=True)

    def warmed() -> SnapshotEncoder:   # every block of `snapshot` encoded (untimed)
        encoder = SnapshotEncoder(BLOCK)
        encoder.encode(snapshot)
        return encoder

    assert warmed().encode(again) == encode_batch(again, BLOCK) and warmed().encode(tenth) == encode_batch(tenth, BLOCK)
    return {
        "zmq_before_ms": timed(lambda: encode_batch(snapshot, BLOCK), repeat),
        "zmq_warm_ms": timed(lambda e: e.encode(again), repeat, warmed),
        "zmq_tenth_new_ms": timed(lambda e: e.encode(tenth), repeat, warmed),
        "zmq_cold_ms": timed(lambda: SnapshotEncoder(BLOCK).encode(snapshot), repeat),
        "zmq_snapshot_bytes": len(encode_batch(snapshot, BLOCK)),
    }


def measure(n: int, repeat: int) -> dict:
    rng = random.Random(n)
    hub = mirror(n, rng)
    snapshot = hub.snapshot()
    assert len(snapshot.ops) == n + 1

    def before():
        ids = itertools.count(1)
        batch_message(snapshot, BLOCK, ids.__next__).SerializeToString()

    def rebuilt():
        hub._snapshot = None   # as after any change of the cache
        hub.snapshot()

    warm = SnapshotSerializer(BLOCK)
    warm._build(snapshot)
    step = KvBatch(1, time.time(), tuple(Stored(rng.getrandbits(63), None, tuple(range(BLOCK))) for _ in range(4)))
    return {
        "blocks": n,
        "before_on_loop_ms": timed(before, repeat),
        "now_on_loop_ms": timed(rebuilt, repeat),
        "now_thread_warm_ms": timed(lambda: warm._build(snapshot), repeat),
        "now_thread_cold_ms": timed(lambda: SnapshotSerializer(BLOCK)._build(snapshot), repeat),
        "snapshot_bytes": len(warm._build(snapshot)),
        "zmq_encode_step_us": timed(lambda: encode_batch(step, BLOCK), repeat * 100) * 1e3,
        **zmq_snapshots(snapshot, rng, repeat),
    }


def table(rows: list[dict]) -> str:
    head = (f"{'blocks':>7}{'before: loop ms':>16}{'now: loop ms':>14}{'thread warm ms':>16}{'cold ms':>9}"
            f"{'snapshot KiB':>14}")
    lines = ["SubscribeKvEvents (gRPC) snapshots", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['blocks']:>7}{r['before_on_loop_ms']:>16.1f}{r['now_on_loop_ms']:>14.2f}"
                     f"{r['now_thread_warm_ms']:>16.1f}{r['now_thread_cold_ms']:>9.1f}"
                     f"{r['snapshot_bytes'] / 1024:>14.0f}")
    head = (f"{'blocks':>7}{'step us':>9}{'snapshot: before ms':>21}{'warm ms':>9}{'1/10 new ms':>13}{'cold ms':>9}"
            f"{'payload KiB':>13}")
    lines += ["", "ZMQ publisher (--kv-events-config), its thread's encoding", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['blocks']:>7}{r['zmq_encode_step_us']:>9.1f}{r['zmq_before_ms']:>21.1f}"
                     f"{r['zmq_warm_ms']:>9.2f}{r['zmq_tenth_new_ms']:>13.1f}{r['zmq_cold_ms']:>9.1f}"
                     f"{r['zmq_snapshot_bytes'] / 1024:>13.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1000, 13000, 100000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="seconds-long: 200 blocks once, nothing written")
    args = parser.parse_args()
    rows = [measure(200, 1)] if args.smoke else [measure(n, args.repeat) for n in args.blocks]
    print(table(rows))
    if args.smoke:
        return
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "cpus_online": os.cpu_count(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
