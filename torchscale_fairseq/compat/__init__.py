"""Fixes the plugin applies to stock fairseq 0.12 on current Python and PyTorch."""
