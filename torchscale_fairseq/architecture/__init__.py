"""Encoder, decoder and encoder-decoder assembled from :mod:`torchscale_fairseq.modules`."""
