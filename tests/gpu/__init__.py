"""Pass/fail checks that need a GPU (run by ``scripts/gpu_check.sh``), each also runnable on
a CPU in a reduced form so that it does not rot where no GPU is at hand."""
