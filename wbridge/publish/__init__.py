"""The publish pipeline: what ``Publisher`` (``wbridge.publisher``) runs, stage by stage.

``register()``
    1. ``staging``: lays the live tensors out (``_tensors.build_layout``; ``register(dtype=)`` casts,
       ``transforms`` FP8-blocks), allocates the staging slots and their stamps, registers them with
       every served transport, and builds the rank's record (``protocol.records``). With deltas,
       ``delta.build_ring`` registers the ring of delta buffers next to the slots.
    2. ``packing.SlotPacker``: made for the registration, packs later slots for the readers' layouts.

``publish()``
    3. ``tracker``: waits as the sync mode says (acks of the version before, a free slot); rank 0
       aggregates every subscriber's state, the other ranks block on the keys it writes.
    4. ``packing``: chooses the slot layout for the reader layouts known now (a packing generation).
    5. ``staging.snapshot``: the trainer's stall. Marks the slot's stamp ``WRITING``, copies (casts,
       packs) the live tensors into it, marks it ``STABLE`` (``protocol.stamps``).
    6. ``delta``: outside the stall, encodes what changed since the version before from the two
       staging slots (``protocol.delta`` is the format), and the slot's chunk checksums.
    7. The last rank to count its snapshot writes the version record and its ``ready`` key
       (``protocol.version``) and collects the keys of an old version (``Publisher._publish_bounded``).
"""
