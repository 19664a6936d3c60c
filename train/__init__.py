"""xtrain: a thin trainer over packs written by xprep."""
