"""The pull pipeline: what ``Subscriber.pull()`` (``wbridge.subscriber``) runs, stage by stage.

Every stage takes the subscriber's ``context.PullContext`` (store, keys, token, transports,
destination, session), never the subscriber; the reads of one version also take its
``context.Attempt`` (record, session, version held, deadline: a ``wbridge._deadline.Deadline``).

``register()``
    ``membership`` joins the channel (store generation, id, lease, record with the layout announced);
    ``context.Endpoints`` registers the destination with each transport as it is opened; with a
    zone, ``zone.join_zone`` starts reading through relays (``relay.RelayServer`` serves a relay's
    buffer).

``pull()``
    1. ``membership.check``: the store generation, its own record and lease, read in one batch with
       the version record and the slots' fences (a lost store or lapsed lease: join again).
    2. ``version.next_version``: the newest committed version record, blocking on its ``ready`` key.
    3. ``apply.apply``, which runs the rest:
       a. ``connect.setup``: once per publisher epoch (or packing generation), reads the publishers'
          records, plans (``planner``), picks and connects a transport per source (``session``).
       b. ``delta``: where the destination holds a recent version whole and ``delta_cost`` finds it
          cheaper on the link, reads only what changed (``delta_reads``); else ``zone`` (relays of
          the zone first: ``peers`` finds and reads them, ``relay.Fetcher`` brings a relay's own
          range and what peers lack from the publishers, ``ranges`` splits them) or ``reads``
          (every source's prepared batch; ``connect.failover`` reads around a dead source).
       c. ``reads.verify_sources`` (with ``verify``) and ``reads.check_stamps``: the seqlock check
          that the slots did not change under the reads.
       d. Staged: copies into the live tensors; the state key acks the version.
"""
