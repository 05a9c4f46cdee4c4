"""Reports of bench-serve results, real or simulated: plots, HTML pages,
side-by-side comparisons and sweeps. Below ``bench`` and ``sim``, above
``workload`` (whose records and summaries they render)."""
