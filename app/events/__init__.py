"""KV events of the shared tier: every committed store or removal of a block, in an order a router can replay, numbered
by one publisher for the whole deployment, and never numbered twice or backwards.

Three parts, each in its own module of this package (``app/events``):

- **The log** (app/index/eventlog.py): with events on, every change of a block row adds a row to the index's event
  log in the change's own transaction, whoever commits it: a gateway process or replica, ``kvgate gc``,
  ``kvgate import``, reconcile. So an event exists iff its change committed, and it survives any crash.
  :class:`EventWriter` is what a gateway process adds to that: the writer's block meta (the PUT's token ids and
  parent, handed down with the PUT: app/core/event_sink.py; kept in the row as one value, the header's own form,
  whose fields the index never reads) and whether the row waits for its parent's (a PUT of the parent in progress
  here: see app/events/order.py), and a release row when such a PUT ends without a store.
- **The publisher** (app/events/publisher.py): one process at a time (the others stand by) tails the log,
  encodes each row on its own (a row the codec refuses is dropped alone), puts parents first, groups rows by topic
  into batches, numbers them from the number it persisted, stores them with where it stands in one transaction, then
  sends them on ZMQ (app/events/zmq_outlet.py: vLLM's wire format).
- **The feed** (app/events/feed.py): ``GET /v1/events`` (JSON) and the ZMQ replay socket read the stored
  batches, so any process serves them, after any restart, as far back as they are kept.

``AllBlocksCleared`` is never sent: a restart clears nothing in the shared tier.

The modules: ``model`` (an event, a batch), ``writer`` (:class:`EventWriter`; the block meta is
``contract.wire.BlockMetaValue``), ``order`` (parents first), ``wire`` (vLLM's format, topics), ``publisher``,
``zmq_outlet``, ``feed``, and ``setup`` (a process's parts, from its settings). The core knows only
``app.core.event_sink.EventSink``; nothing in ``app.core`` or ``app.index`` imports this package.
"""
