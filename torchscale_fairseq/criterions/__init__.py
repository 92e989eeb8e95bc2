"""criterions of torchscale-fairseq."""
