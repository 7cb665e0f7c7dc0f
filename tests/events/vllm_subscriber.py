"""Run with the oracle venv's python: subscribe to a kvgate gateway's KV events with vLLM 0.33's own classes.

As vLLM's examples/online_serving/kv_events_subscriber.py does: a SUB socket for the live stream and a DEALER socket
on the replay endpoint; on a gap (or when the live stream stays silent) ask for a replay from the first number
missing. Prints ``ready`` once connected, then one JSON document: the events decoded, in sequence order, the topic
of each batch, and whether each payload is byte for byte what vLLM's own encoder makes of the batch it decodes to.

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
            "locality": event.locality,
            "ownership": event.ownership,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": event.medium,
            "group_idx": event.group_idx,
            "locality": event.locality,
            "ownership": event.ownership,
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

    encoder = msgspec.msgpack.Encoder()
    batches: dict[int, KVEventBatch] = {}
    topics: dict[int, str] = {}
    exact: dict[int, bool] = {}
    replayed: list[int] = []

    def take(topic: bytes, seq: int, payload: bytes) -> bool:
        if seq in batches:
            return False
        batches[seq] = decoder.decode(payload)
        topics[seq] = topic.decode()
        exact[seq] = encoder.encode(batches[seq]) == payload
        return True

    next_seq = first

    def have() -> int:
        return sum(len(b.events) for b in batches.values())

    def ask_replay(start: int) -> None:
        replay.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            _empty, topic, seq_bytes, payload = replay.recv_multipart()
            if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                return
            seq = int.from_bytes(seq_bytes, "big")
            if take(topic, seq, payload):
                replayed.append(seq)

    deadline = time.monotonic() + 120
    while have() < wanted and time.monotonic() < deadline:
        if sub.poll(1000):
            topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > next_seq and next_seq not in batches:
                ask_replay(next_seq)  # a gap: what was missed, from the replay socket
            take(topic, seq, payload)
        else:
            ask_replay(next_seq)  # silence: the live stream may have begun before we joined
        while next_seq in batches:
            next_seq += 1
    seqs = sorted(batches)
    events = [as_json(e) for s in seqs for e in batches[s].events]
    doc = {
        "seqs": seqs,
        "replayed": replayed,
        "events": events,
        "topics": [topics[s] for s in seqs],
        "exact": [exact[s] for s in seqs],
    }
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
