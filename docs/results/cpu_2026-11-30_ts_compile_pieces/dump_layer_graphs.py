"""``fairseq-train`` with the layers' residual dropout on the GPU's path (``F.dropout``; on the CPU the plugin
draws the mask itself), so that ``TORCH_COMPILE_DEBUG=1`` dumps the compiled layer's graphs as a GPU run traces
them: ``python dump_layer_graphs.py FAIRSEQ_TRAIN_ARGS``."""

import sys

import torch.nn.functional as F
from fairseq_cli.train import cli_main

import torchscale_fairseq.architecture.layer as layer

layer.dropout_add = lambda residual, y, p, training: residual + F.dropout(y, p, training)

if __name__ == "__main__":
    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
