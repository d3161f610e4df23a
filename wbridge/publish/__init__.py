"""The publish pipeline: what ``Publisher`` (``wbridge.publisher``) runs, stage by stage.

Every stage gets a narrow typed context (``register.Registrar``, ``commit.Committer``,
``waits.SyncWaits``, ``inflight.InFlight``), never the publisher.

``Publisher(...)``
    ``register.serve`` opens the transports the rank serves; ``tracker``, ``waits`` and ``commit``
    get their contexts over the store (again in each new store generation).

``register()``
    1. ``inflight``: waits out the publish in flight, if any.
    2. ``register``: checks the arguments, then ``build``: lays the live tensors out
       (``_tensors.build_layout``; ``register(dtype=)`` casts, ``transforms`` FP8-blocks), and
       ``staging.build_registration`` allocates the staging slots and their stamps and registers
       them with every served transport (``delta.build_ring``: the ring of delta buffers next to
       them, with deltas).
    3. ``register.announce``: joins the store's generation, makes the ``packing.SlotPacker`` that
       packs later slots for the readers' layouts, counts the epoch (``register.Epochs``) and writes
       the rank's record (``protocol.records``); the old registration is released and the records
       of old epochs collected (``Epochs.collect``).

``publish()`` (``publish_async()``: the same on ``inflight``'s worker thread)
    4. ``waits.before_snapshot``: waits as the sync mode says (acks of the version before, a free
       slot) through the ``tracker``: rank 0 aggregates every subscriber's state, the other ranks
       block on the keys it writes.
    5. ``packing``: chooses the slot layout for the reader layouts known now (a packing generation).
    6. ``commit.snapshot``: bumps the slot's fence, then ``staging.snapshot``, the trainer's stall:
       marks the slot's stamp ``WRITING``, copies (casts, packs) the live tensors into it, marks it
       ``STABLE`` (``protocol.stamps``). Outside the stall, ``delta`` encodes what changed since the
       version before from the two staging slots (``protocol.delta`` is the format), and the slot's
       chunk checksums.
    7. ``commit.commit``: the last rank to count its snapshot writes the version record and its
       ``ready`` key (``protocol.version``) and collects the keys of an old version.
    8. ``waits.after_commit``: in ``sync`` mode (and zero copy), the acks of the version;
       ``commit.fence_off`` fences a zero-copy version off once ``publish()`` returns.
"""
