"""``python -m bench.fleet_sim``: N servers of PCR's chunk tree, routing policies and a shared
tier, simulated. The simulator is :mod:`pcr_eval.sim.fleet`, whose docstring (and
``--help``) says what is modelled."""

from __future__ import annotations

import sys

from pcr_eval.sim.fleet import main

if __name__ == "__main__":
    sys.exit(main())
