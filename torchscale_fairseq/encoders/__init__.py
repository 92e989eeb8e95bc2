"""fairseq ``--bpe`` encoders of torchscale-fairseq."""
