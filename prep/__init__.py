"""xprep: offline data preparation (tokenize, pack, inspect). Never imports torch.distributed."""
