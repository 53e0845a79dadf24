"""The RAG serving benchmark's library (``python -m bench.ragbench``): the seeded retrieval
trace (:mod:`.workload`, :mod:`.retrieval`), servers per configuration and the replay
(:mod:`.runner`), the report (:mod:`.report`), what its commands share (:mod:`.common`), the
full comparison (:mod:`.compare`), the operating points, the headline and the cross-check
against SGLang's own client."""
