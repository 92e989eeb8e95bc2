import sys
import torch.nn.functional as F
import torchscale_fairseq.architecture.layer as L
L.dropout_add = lambda r, y, p, t: r + F.dropout(y, p, t)  # the GPU's path (F.dropout), traced on the CPU
from fairseq_cli.train import cli_main
sys.argv = ["fairseq-train"] + sys.argv[1:]
cli_main()
