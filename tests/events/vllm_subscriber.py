"""Run with the oracle venv's python: subscribe to a kvgate gateway's KV events with vLLM 0.33's own classes.

As vLLM's examples/online_serving/kv_events_subscriber.py does: a SUB socket for the live stream and a DEALER socket
on the replay endpoint; on a gap (or when the live stream stays silent) ask for a replay from the first number
missing. Prints ``ready`` once connected, then one JSON document: the events decoded, in sequence order.

argv: PUB_ENDPOINT REPLAY_ENDPOINT FIRST_SEQ N_EVENTS
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch


def as_json(event: object) -> dict[str, object]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "medium": event.medium,
            "group_idx": event.group_idx,
            "lora_name": event.lora_name,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
            "group_idx": event.group_idx,
        }
    return {"type": type(event).__name__}


def main() -> None:
    pub, replay_endpoint, first, wanted = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    replay = ctx.socket(zmq.DEALER)  # one request, many replies (a REQ socket takes one reply)
    replay.connect(replay_endpoint)
    print("ready", flush=True)

    batches: dict[int, KVEventBatch] = {}
    replayed: list[int] = []
    next_seq = first

    def have() -> int:
        return sum(len(b.events) for b in batches.values())

    def ask_replay(start: int) -> None:
        replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            _empty, _topic, seq_bytes, payload = replay.recv_multipart()
            if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq not in batches:
                batches[seq] = decoder.decode(payload)
                replayed.append(seq)

    deadline = time.monotonic() + 120
    while have() < wanted and time.monotonic() < deadline:
        if sub.poll(1000):
            _topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > next_seq and next_seq not in batches:
                ask_replay(next_seq)  # a gap: what was missed, from the replay socket
            batches.setdefault(seq, decoder.decode(payload))
        else:
            ask_replay(next_seq)  # silence: the live stream may have begun before we joined
        while next_seq in batches:
            next_seq += 1
    seqs = sorted(batches)
    events = [as_json(e) for s in seqs for e in batches[s].events]
    print(json.dumps({"seqs": seqs, "replayed": replayed, "events": events}), flush=True)


if __name__ == "__main__":
    main()
