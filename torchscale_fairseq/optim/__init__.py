"""optim of torchscale-fairseq."""
