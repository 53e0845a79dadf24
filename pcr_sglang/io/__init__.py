"""The I/O process: SSD reads, writes and deletes, off the scheduler; its protocol, its
sockets and its supervisor."""
