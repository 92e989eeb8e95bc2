"""tasks of torchscale-fairseq."""
