"""Simulations over PCR's core tree, run without a server: look-ahead LRU against plain LRU
(:mod:`.lookahead`), a fleet of servers with routing policies and a shared tier
(:mod:`.fleet`), and the tree's per-chunk costs as it grows (:mod:`.tree_costs`). Their
commands are ``python -m bench.lookahead_sim``, ``bench.fleet_sim`` and
``bench.tree_microbench``."""
