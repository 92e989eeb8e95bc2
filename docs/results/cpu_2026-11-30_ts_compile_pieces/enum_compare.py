"""Whether a compiled function takes the branch eager Python takes when it compares fairseq's ``ChoiceEnum``
member (as fairseq-train's typed config holds ``--activation-fn gelu``) with the string ``"gelu"``."""

import torch
import torch.nn.functional as F
from fairseq.dataclass import ChoiceEnum

activation = ChoiceEnum(["gelu", "relu"]).gelu
print("eager ==", activation == "gelu")


@torch.compile(backend="eager")
def activate(x: torch.Tensor, act) -> torch.Tensor:
    return F.gelu(x) if act == "gelu" else F.relu(x)


x = torch.tensor([-1.0, 1.0])
print("compiled:", activate(x, activation), "gelu:", F.gelu(x), "relu:", F.relu(x))
