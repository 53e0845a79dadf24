"""Tools around the pcr-sglang server plugin: the launcher, the demo, a fleet of servers, the
Mooncake services, the SSD store CLI, corpus precompute, the retrieval CLI, the model
builders, document-reuse tuning and calibration, and the data and workloads they use.

The server (:mod:`pcr_sglang`) never imports this package (a test walks the imports); the
tools import the server's modules freely. Each command has a console script and a
``python -m`` form: ``pcr-demo`` (``pcr_tools.demo``), ``pcr-fleet``, ``pcr-store``
(``pcr_tools.store_cli``), ``pcr-precompute``, ``pcr-rag`` (``pcr_tools.rag_cli``),
``pcr-tune`` (``pcr_tools.tune``) and ``pcr-calibrate``.
"""
