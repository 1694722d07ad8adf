"""What the RLlib integration's other modules and its ``replay/`` package both stand on: the state
names and logger (``names``), RLlib state <-> storable state (``conversion``), optimizer parameters
outside a learner's modules (``learner_params``) and every private RLlib API relied on
(``_rllib_internals``). A package of its own so that ``replay/`` sits wholly below the modules that
import it (``tests/test_architecture.py`` follows every package at its own level). Imports nothing
of the rest of the integration."""
