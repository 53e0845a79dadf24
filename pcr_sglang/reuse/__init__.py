"""Document reuse in any order (``--pcr-doc-reuse``), the whole feature in one wing.

Pure (no torch, no SGLang): :mod:`~pcr_sglang.reuse.bounds` (the request contract),
:mod:`~pcr_sglang.reuse.plan` (what is reused where; the row order),
:mod:`~pcr_sglang.reuse.warmup` (when a document's KV is computed),
:mod:`~pcr_sglang.reuse.calibration` (the per-model gate's file),
:mod:`~pcr_sglang.reuse.settings` (its settings from ``PCRConfig``).
On the model: :mod:`~pcr_sglang.reuse.setup` (the startup gate),
:mod:`~pcr_sglang.reuse.model_rope`, :mod:`~pcr_sglang.reuse.placement` (copy and rotate at
admission), :mod:`~pcr_sglang.reuse.blend_select` (blend's selectors and their probe),
:mod:`~pcr_sglang.reuse.rows` (true positions and position-causal masks in the forward),
:mod:`~pcr_sglang.reuse.tokenizer` (the HTTP side: bounds checked at the door, warm-ups),
:mod:`~pcr_sglang.reuse.reorder` (``reorder``: documents put in an order already served, exact),
:mod:`~pcr_sglang.reuse.disabled` (the null collaborator the scheduler holds without it).
The SGLang adapter calls into this wing through its typed seam, :mod:`~pcr_sglang.reuse.seam`
(the scheduler's half, the forward's half, what is reported); the wing never imports the adapter. The client's
side (marked prompts, the DSL's ``doc()``) is :mod:`pcr_client`.
"""
