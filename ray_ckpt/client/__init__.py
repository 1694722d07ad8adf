"""The client: what a training program holds and calls.

``engine`` (``CheckpointEngine``: create / connect, save, submit, load, restore) with its mixins
``rank_push`` (pushed states) and ``in_flight`` (backpressure), ``handle`` (``SaveHandle``), ``push_batch`` (ranks' parts sent in batches), ``run_lifetime`` and
``coordinator_client`` (starting, finding and stopping a run's actors), ``reading`` (load and
load_into) over ``restore`` (plan, stage, verify, apply), ``progress`` (progress lines on stderr).

May import ``coordinator``, ``writers``, ``capture``, ``formats``, ``storage`` and the root's
vocabulary; imported by the public API (``ray_ckpt``), ``integrations`` and ``cli`` only. Nothing is
imported at package import: these modules bring in Ray.
"""
