"""Blend's selectors: what ranks the re-placed tokens that ``blend`` recomputes.

The one list. ``--pcr-doc-selector`` offers it (``flags_documents.py``), a request may ask for one of
it in ``custom_params["pcr_doc_selector"]`` (``reuse/bounds.py``), and
:mod:`~pcr_sglang.reuse.blend_select` runs them. It imports nothing, so the flag
declarations may read it while SGLang is still assembling its ``ServerArgs``.
"""

from __future__ import annotations

# ``deviation`` (CacheBlend: layer-1 V against full prefill's), ``gradual`` (the paper's
# gradual filtering: layer 1 keeps twice the budget, layer 2's deviation picks), ``query``
# (the question's layer-1 attention on each token) or ``prophet`` (the question's attention
# fused over layers 1-4, the upper ones over the re-placed KV, as ProphetKV).
SELECTORS = ("deviation", "gradual", "query", "prophet")
# gradual: the most accurate at the same budget in bench/doc_reuse_accuracy (2026-12-06,
# docs/document-reuse.md "Choosing the recomputed tokens"). The server's default and a
# request's without one.
DEFAULT_SELECTOR = "gradual"
QUESTION_SELECTORS = ("query", "prophet")  # the selectors that read the question
