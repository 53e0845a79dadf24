"""Moving KV between SGLang's device KV pool and PCR's host chunk slots: the layout, the
copy kernels (Triton on CUDA, torch elsewhere) and the transfer engine with tickets."""
