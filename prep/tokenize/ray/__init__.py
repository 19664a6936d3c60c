"""``xprep tokenize --ray``: the cluster driver, its shards and their staging area."""
