"""The I/O process: SSD reads (prefetch, on-demand loads) and write-back, off the scheduler."""
