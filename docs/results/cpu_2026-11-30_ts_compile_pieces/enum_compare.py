import torch, torch.nn.functional as F
from fairseq.dataclass import ChoiceEnum
C = ChoiceEnum(["gelu", "relu"])
a = C.gelu
print("eager ==", a == "gelu")
@torch.compile(backend="eager", fullgraph=False)
def f(x, act):
    return F.gelu(x) if act == "gelu" else F.relu(x)
x = torch.tensor([-1.0, 1.0])
print("compiled:", f(x, a), "gelu:", F.gelu(x), "relu:", F.relu(x))
