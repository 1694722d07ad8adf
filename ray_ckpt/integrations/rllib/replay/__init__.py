"""RLlib's replay buffers saved as a journal of what their own entry points received (format
``ray_ckpt.rllib.replay/6``). :mod:`.algorithm` is what the callback and the restore call.
Versions of the formats before it (``replay`` + ``replay_meta``) are rewritten by ``ray-ckpt
migrate``, which alone reads them (``ray_ckpt/cli/legacy_replay.py``).

Why a journal: a buffer changes only through ``add()`` and, prioritized, ``update_priorities()``;
writing what they received costs O(what arrived) per save. A restore replays it through RLlib's API:
each episode is ``from_state`` of its first chunk with the next ones ``concat_episode``-ed to it (what
``add()`` did), then ``set_state()`` with the index lists and trees the records give.

One state, ``replay_journal``, registered ``append_only=True``: rows ``row_id`` (int64) and ``blob``
(uint8[256]); a record is a run of consecutive rows (:mod:`.records`). Records:

========== ===============================================================================
``ADD``    one ``add()`` call: the chunks it kept (their states, :mod:`.episodes`), the buffer
           episode index each went to, the entries the call appended to ``_indices`` (with
           the segment-tree leaf of each, prioritized) and the weight their leaves got. Live
           while any of its episodes is in the buffer.
``PRIO``   the ``update_priorities()`` calls since the save before: the leaves each call
           changed and the priorities it received. Live until a newer ``STATE``.
``STATE``  a whole ``_indices`` and, prioritized, every live leaf's value: written by a full
           capture (a buffer the journal did not see fill, or one changed behind ``add()``) and
           when the ``PRIO`` records outgrow the buffer. Live while it is the newest and any of
           its entries' episodes is in the buffer.
========== ===============================================================================

Scalars beside the rows: ``format`` and ``meta``, RLlib's ``get_state()`` without the episodes and
without what the records give (``episode_id_to_index``, ``_indices``, the trees), plus what
``get_state()`` leaves out: the sampling generator, the metrics, the capacity, the space table and,
prioritized, the free-node deque, the maximum priority and leaf index, the last sampled indices.

Multi-agent buffers: each module's index list and trees are journaled as ``_indices`` is
(:mod:`.journal`); the episodes' mapping function is the restoring algorithm's ``policy_mapping_fn``.

Exact (tests compare every attribute and the next samples) except two things no buffer method
reads: a multi-agent episode's ``_len_lookback_buffers`` (not in RLlib's ``get_state()``; only
``cut()`` and ``add_env_*`` use it) and the stale keys RLlib's evictions leave in
``MultiAgentPrioritizedEpisodeReplayBuffer._sample_idx_to_tree_idx`` (keys at or past the number
of env steps; RLlib only sets and pops live ones): the restore sets the live keys only.

Two states RLlib itself leaves inconsistent are not reproduced: a prioritized leaf that
``update_priorities()`` writes after an ``add()`` freed it (sampled, then evicted before the update:
RLlib's trees then hold a priority for a free leaf, which its next ``sample()`` can draw and fail
on) comes back free; and where RLlib's multi-agent ``add()`` is given two chunks of an episode it
evicts in the same call (it drops one of them), the journal finds the call's index entries are
not the chunks' and the next save writes the buffer whole (exactly).
"""
