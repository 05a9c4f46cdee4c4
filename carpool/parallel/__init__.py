"""One replica over several processes: tensor parallelism (``group``: the
collectives; ``shard``: a loaded model cut to one rank's slice)."""
