"""RLlib's off-policy replay buffers (``algorithm.local_replay_buffer``) <-> two storable states.

Supported: the new API stack's ``EpisodeReplayBuffer``, ``PrioritizedEpisodeReplayBuffer``,
``MultiAgentEpisodeReplayBuffer`` and ``MultiAgentPrioritizedEpisodeReplayBuffer`` (Ray 2.60), and
subclasses of them that add no state of a kind listed nowhere here (anything else raises
:class:`~ray_ckpt.UnsupportedTypeError` naming the buffer type and the attribute).

Why not RLlib's own ``get_state()``: it is incomplete for an exact resume and not storable as is. It
leaves out the buffer's sampling generator ``rng`` (a restored buffer would draw other batches), its
``metrics`` and its capacity; the multi-agent prioritized one returns the segment-tree *objects*
and its ``set_state`` rebuilds missing min-trees as sum-trees; episodes come back as nested dicts
of per-episode arrays (thousands of small leaves), the prioritized trees as Python lists of
``2 * 2**ceil(log2(capacity))`` floats each, and ``MultiAgentEpisode.get_state()`` holds a function
and gym spaces. So the buffer is read attribute by attribute: every attribute of the instance must
be one this package knows (or a plain JSON/numpy value, kept under ``extra_attrs``).

Single-agent buffers are saved incrementally in format /4 (:mod:`.incremental_state`: the rows
below, and ``replay_meta`` as an append-only log of records compressed against a dictionary record
-- the episodes that ended, the priorities that changed, the meta -- so a save converts and writes
only what changed, in two files and two small indexes); multi-agent buffers likewise in format /5
(:mod:`.incremental_multi_agent`: the same log, with the multi-agent episodes' own states,
RLlib's env-step index list and, prioritized, the key order of ``_sample_idx_to_tree_idx``
(:mod:`.key_order`) as records of it). A restore turns those back into the two-state form
below and restores that. The two-state form itself (format /1) was how multi-agent buffers were
saved before (rows append-only, ``replay_meta`` whole): such versions are still restored.

The two states (names ``replay`` and ``replay_meta`` in a version):

``replay`` -- a ray_ckpt *buffer* (one Arrow IPC file): ONE ROW PER STORED TIMESTEP (per agent
timestep in the multi-agent buffers), in the order the buffer added them, columns:

=================== ======= ===============================================================
``row_id``          int64   stable id of the timestep, strictly increasing (see below)
``episode``         int64   the buffer's episode index of it (``_indices[i][0]``: a counter of
                            episodes ever added, never reused; ``- _num_episodes_evicted`` is its
                            position in ``buffer.episodes``)
``t``               int32   timestep within that (agent) episode, 0 = its first stored step
``tree``            int32   prioritized only: the leaf of this row in the sum/min trees
                            (single-agent) or in its module's trees (multi-agent)
``agent``/``module`` int32  multi-agent only: codes into ``replay_meta["rows"]["agent_ids"]`` /
                            ``["module_ids"]``
``obs``             *       the observation *at* t (``observations[t]``; a dict/tuple observation
                            space gives one column per leaf: ``obs/<key>/<index>``)
``action``, ``reward``      ``actions[t]``, ``rewards[t]`` (nested spaces: as ``obs``)
``extra/<key>``             ``extra_model_outputs[key][t]`` (``action_logp``, ``weights_seq_no``...)
=================== ======= ===============================================================

plus the scalar ``layout`` (``"rllib_episode_rows/1"``). Per-row shapes are fixed-shape columns.
Everything a timestep holds that never changes once the buffer has it is in its row. Not in rows:
each episode's *last* observation (episodes hold ``len + 1`` observations: ``obs[len]`` is the
next-observation of the last step and is replaced when a later chunk of a running episode arrives),
lookback data before ``t_started`` (continuation chunks whose start was evicted), and infos (dicts):
those are in ``replay_meta``.

**How row_id is derived, and why it is stable.** A row is identified by its key ``(episode, t)``
(``(episode, agent, t)``): the episode index is a counter RLlib never reuses, and a timestep keeps
its index within its episode forever (episodes only grow at the end: ``concat_episode`` pops the
last observation, appends the new chunk's data, and asserts the boundary observations are equal),
so a key's content never changes while the key is in the buffer. RLlib appends the keys of newly
added timesteps to the *end* of ``_indices`` (and of each module's ``_module_to_indices`` list) and
evicts whole episodes, oldest first (``episodes.popleft()``), filtering their keys out wherever they
are -- so the keys that survive from the previous save come first, in their old order, and all new
keys follow. Each save therefore drops the cached keys of episodes below ``_num_episodes_evicted``,
checks that the current list starts with the survivors, and gives the ``n_new`` keys after them the
ids ``max(previous max + 1, added - n_new) ...`` where ``added`` is RLlib's lifetime counter of
added timesteps (``_num_timesteps_added``; ``_num_agent_timesteps_added`` for multi-agent): a row's
id is then the number of timesteps the buffer had been given before it (exact while nothing was
evicted between two saves, never smaller than the previous max + 1). Old rows keep their ids; ids
are never reused; evicted rows disappear wherever they were. The cache lives beside the buffer (a
weak map); :func:`.two_state.restore_replay` seeds it from the restored rows, so ids continue after a resume.
If the check fails (a buffer changed behind RLlib's ``add``), unknown keys that form a suffix get
new ids; otherwise every row gets a new id (a full rewrite, logged). A buffer restored from another
run (PBT), from an older version, or a new buffer saved into a run that has versions, gets new ids
for all its rows at its first save, above the newest version's ``next_row_id`` (its old ids could
name other rows there): that save writes the whole buffer once
(:func:`.algorithm.capture_algorithm_replay`).

``replay_meta`` -- a nested state of numpy arrays and JSON scalars (no pickle): ``format``,
``buffer_type``, ``config`` (capacity, batch_size_B, batch_length_T, alpha...), ``counters``
(``_num_timesteps``, ``_num_timesteps_added``, ``_num_episodes_evicted``, ``sampled_timesteps``,
``_num_agent_timesteps[_added]``), ``module_counters`` (multi-agent per-module counters), ``rng``
(the ``rng`` generator's bit-generator state), ``metrics`` (the buffer's MetricsLogger state, or
None with the reason in ``not_saved``), ``rows`` (``next_row_id``, ``n_rows``, the agent/module id
tables, each field's structure with column names as leaves, multi-agent: ``env_indices`` (RLlib's
env-step ``_indices``) and ``module_order``), ``spaces`` (the distinct spaces, as
``gym_space_to_dict``), ``episodes`` (columnar, one entry per (agent) episode: key, len, id,
agent/module ids, t_started, t, terminated/truncated, start/last-step times -- exact types --,
space codes, custom_data, extra-model-output keys; per field: lookback, finalized, space, list
kind, data length and the head (lookback) + tail (the last observation) data per column; infos:
lookback, length and the entries that are not ``{}``), ``ma_episodes`` (multi-agent: per episode
its agents, agent-to-module mapping, spaces, env_t(_started), agent_t_started, env_t_to_agent_t,
hanging actions/rewards/extra outputs, flags, times, custom_data), ``priority`` (prioritized: the
sum-tree leaf of every row with its exact Python/numpy type (``{"v", "k", "kinds"}``; the min-tree
leaves are ``{"same_as_sum": True}`` -- RLlib sets both to the same value -- or their own),
``_max_priority``, ``_max_idx``, the free-node deque as ``prefix + range(start, stop)``,
``_last_sampled_indices``, the tree capacity; multi-agent: the same for the env-step trees (leaves
aligned with ``env_indices``), ``_sample_idx_to_tree_idx`` as it is, and per module its trees'
row leaves, free nodes, max priority / idx, last sampled, with each map's key order),
``extra_attrs`` (plain attributes of a subclass).

The trees' inner nodes are not stored: every inner node of RLlib's ``SegmentTree`` equals
``op(left child, right child)`` of the current children (``__setitem__`` recomputes the path to the
root), so :func:`.two_state.restore_replay` recomputes them from the leaves, bit for bit and with the same
Python/numpy types. Leaves that belong to no row must hold the neutral element (0.0 / inf: checked
at every save, by value). ``_tree_idx_to_sample_idx`` (spot-checked at each save: 257 entries),
``episode_id_to_index`` (checked) and the module maps are derived from the rows and episodes.

What is not exact: ``SingleAgentEpisode._last_added_observation`` / ``_last_added_infos`` (used only
while an env runner builds an episode; RLlib's own ``from_state`` drops them too) come back None;
``MultiAgentEpisode.agent_to_module_mapping_fn`` is not stored (a function): the restore sets the
algorithm's ``policy_mapping_fn`` (or the one passed); restored episodes share one gym space object
per distinct space (equal, not separate copies); a multi-agent buffer with non-str agent ids has no
metrics state (RLlib's ``MetricsLogger.get_state`` fails on them): its metrics restart empty. Not
supported (refused by name): agents whose spaces differ in one buffer, non-numpy'ized nested data.
Format /1's meta is O(rows) for prioritized buffers (the per-row leaves: 8-9 bytes per row) and for
multi-agent buffers (env-step keys and env-to-agent step maps); for the others it grows only with
episodes and with infos that are not ``{}``.

Modules, lowest first (each imports only modules above it in this list; none imports this package):

============================ ===========================================================================
``values``                   exact scalars (value and Python/numpy type) and the gym spaces table
``buffers``                  the supported buffer classes, their attributes, the meta every family shares,
                             format /1's tag
``episode_parts``            (agent) episodes -> parts (timestep bodies, edges, scalars), the rows'
                             columns and the columnar episode table; the table read back into parts
``episode_rebuild``          rows + episode table -> ``SingleAgentEpisode`` objects
``growth``                   the captures' per-row caches kept without copying every row each save
                             (survivors of an eviction as views, new rows appended into room)
``row_ids``                  stable row ids across saves (:class:`~.row_ids.RowIds`, kept beside each buffer)
``segment_trees``            sum/min segment trees and free-node deques <-> their row leaves
``priorities``               the priority part of format /1's meta, and the trees restored from it
``multi_agent``              multi-agent buffers captured in format /1 (no longer saved; tests make it); their
                             index lists and episodes' own states; their episodes rebuilt
``records``                  a log record's bytes: arrays narrowed and shuffled, compressed with a dictionary
``incremental_state``        format /4: its names and tags, the per-buffer cache, the log's records
``incremental_priorities``   formats /4 and /5, prioritized: ``prio`` columns and the priority records
``incremental_capture``      format /4: a single-agent buffer's capture (only what changed)
``incremental_restore``      format /3 or /4 -> format /1's two states; the caches seeded after a restore
``key_order``                format /5, prioritized: ``_sample_idx_to_tree_idx``'s key order as log records
                             (a base, then what each save changed)
``incremental_multi_agent``  format /5: a multi-agent buffer's capture (only what changed)
``incremental_ma_restore``   format /5 -> format /1's two states; either log format's restore and seeding
``two_state``                ``capture_replay`` / ``restore_replay``: any buffer <-> format /1's two states
``compare``                  two buffers' complete states compared (tests, verification)
``algorithm``                the entry points the RLlib callback and restore call (strategy, capture into a
                             save, registrations, restore of a version)
============================ ===========================================================================
"""
