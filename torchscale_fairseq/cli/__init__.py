"""cli of torchscale-fairseq."""
