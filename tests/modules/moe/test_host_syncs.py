"""Host synchronisations of one X-MoE training step at expert-parallel size 1, counted on the CPU.

On a GPU the host waits for the stream whenever it reads a tensor's value (``.item()``,
``int()``/``float()``/``bool()`` of a tensor: ``aten._local_scalar_dense``; ``.tolist()``,
``.numpy()``, ``.cpu()``) and whenever an op's output shape depends on the data (``nonzero``,
boolean-mask indexing, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave``
without ``output_size``). A CPU has no stream, so the test counts them where they are issued:
a ``TorchDispatchMode`` sees the ops, a ``TorchFunctionMode`` the Python conversions.

Budget of one forward and backward of ``ts_lm`` and ``moe_cross_entropy`` (top-2, capacity
factor 1.25, the second expert as each ``--moe-second-expert-policy`` draws it, no activation
checkpointing, a batch with right padding), measured with 1 and with 2 MoE layers so that the
per-layer and the per-step parts are each checked:

- per step: 2 (``int`` of the largest position, and the criterion's one read of its logged
  figures: gate and z-loss, every layer's load CV, dropped and routed assignments, entropy);
- per MoE layer: none with grouped-GEMM experts (routing, capacity, balance loss, statistics and
  dispatch keep fixed shapes on the device: issue 26 item 2), and exactly one with one GEMM per
  expert (the loop reads the rows per expert on the host). None in backward.

One sync more anywhere fails the test with the places it happened.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.cli_utils import USER_DIR
from tests.workers.dist_harness import sample_of

PER_STEP = 2
PER_MOE_LAYER = {"grouped": 0, "loop": 1}
DATA_DEPENDENT = {"aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim",
                  "aten.unique_consecutive", "aten.bincount"}
CONVERSIONS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}


def _site() -> str:
    """The innermost frame of the plugin or fairseq that issued the current op."""
    frames = [f for f in traceback.extract_stack() if "torchscale_fairseq" in f.filename or "/fairseq/" in f.filename]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "elsewhere"


class HostSyncs(TorchDispatchMode):
    """Counts, by place, the ops that make a GPU's host wait (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if (name == "aten._local_scalar_dense" or name in DATA_DEPENDENT
                or (name == "aten.index" and any(t is not None and t.dtype == torch.bool for t in args[1]))
                or (name == "aten.repeat_interleave" and kwargs.get("output_size") is None)):
            self.sites[f"{name} at {_site()}"] += 1
        return func(*args, **kwargs)


class HostConversions(TorchFunctionMode):
    """Counts ``.tolist()``, ``.numpy()`` and ``.cpu()`` (no aten op on a CPU tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in CONVERSIONS:
            self.sites[f"{func.__name__} at {_site()}"] += 1
        return func(*args, **(kwargs or {}))


def _step_syncs(data, moe_freq: int, experts: str, policy: str) -> tuple[int, Counter]:
    argv = [str(data), "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "ts_lm_tiny", "--cpu",
            "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
            "--decoder-layers", "2", "--tokens-per-sample", "16", "--dropout", "0", "--criterion",
            "moe_cross_entropy", "--moe-expert-count", "4", "--moe-freq", str(moe_freq), "--moe-top-k", "2",
            "--moe-second-expert-policy", policy, "--optimizer", "adam"]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    model.train()
    for module in model.modules():
        if type(module).__name__ == "GroupedExperts":
            module.grouped_mm = experts == "grouped"
    d = task.target_dictionary
    tokens = torch.randint(d.pad() + 1, len(d), (4, 17), generator=torch.Generator().manual_seed(3))
    tokens[1, 12:] = d.pad()  # right padding: the MoE layers get a padding mask
    sample = sample_of(tokens)
    syncs, conversions = HostSyncs(), HostConversions()
    with syncs, conversions:
        loss, _, _ = criterion(model, sample)
        loss.backward()
    layers = sum(1 for m in model.modules() if type(m).__name__ == "MoELayer")
    return layers, syncs.sites + conversions.sites


@pytest.mark.parametrize("experts, policy", [("grouped", "random"), ("grouped", "sampling"), ("grouped", "all"),
                                             ("loop", "random")])
def test_host_syncs_of_an_moe_step_within_budget(experts, policy, lm_data):
    counted = {}
    for moe_freq in (2, 1):
        layers, sites = _step_syncs(lm_data, moe_freq, experts, policy)
        counted[layers] = sites
    assert sorted(counted) == [1, 2]
    one, two = (sum(counted[n].values()) for n in (1, 2))
    per_layer, per_step = two - one, 2 * one - two
    where = "\n".join(f"{n} x {site}" for site, n in sorted(counted[2].items()))
    assert per_layer == PER_MOE_LAYER[experts] and per_step <= PER_STEP, (
        f"{per_step} host syncs per step (budget {PER_STEP}) and {per_layer} per MoE layer (expected "
        f"{PER_MOE_LAYER[experts]}); with 2 MoE layers:\n{where}")
    assert per_step > 0, "the counter must see the criterion's read (else it counts nothing)"
