"""Fine-tuning a model for document reuse (TurboRAG's recipe): train on the attention
pattern the server serves, by self-distillation from the model's own full prefill and, for
the questions a document's first sentence answers, its gold sentence.

``python -m pcr_tools.tune --help``. :mod:`.served_pattern` is the served forward,
:mod:`.questions` the data (split by article), :mod:`.train` the loop.
"""
