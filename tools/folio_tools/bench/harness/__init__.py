"""What every benchmark shares: flags and result paths, seeded workloads, the machine's peaks (MFU/MBU),
tables and plots, paired rounds, a `folio serve` to measure, and what it holds."""
