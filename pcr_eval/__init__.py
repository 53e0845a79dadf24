"""Evaluation of pcr-sglang: the accuracy of document reuse and the benchmarks' library.

One place for what the benchmarks under ``bench/`` and calibration measure and how: the
measured configurations (:mod:`.modes`), questions as token prompts (:mod:`.gold`), answer
scores (:mod:`.scores`), teacher forcing (:mod:`.forcing`), bootstrap intervals
(:mod:`.stats`), the requests a measurement sends (:mod:`.requests`), one question measured
(:mod:`.measure`), calibration's measuring (:mod:`.calibration`), the accuracy benchmark and
its workloads (:mod:`.accuracy`, :mod:`.questions_workload`, :mod:`.trace_workload`, their
reports, :mod:`.reorder_applicability`), pooling runs (:mod:`.pool`), TTFT over server starts
(:mod:`.ttft`), the RAG serving benchmark (:mod:`.ragbench`) and the simulators
(:mod:`.sim`).

``bench/`` keeps the commands (``python -m bench.doc_reuse_accuracy`` and the rest), each a
thin module over this package; tests import this package, never ``bench``. This package may
import the tools (:mod:`pcr_tools`) and the client; the server, the client and the wire words
import nothing of it (a test walks the imports).
"""
