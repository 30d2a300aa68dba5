"""A run directory and what is written in it: ``run_dir.RunDir`` (every path, the claim, the records read and
written) and ``run_records`` (one dataclass per kind of record). Nothing here imports torch."""
