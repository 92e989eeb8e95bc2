"""fairseq registrations of the ts models."""

from torchscale_fairseq.models import lm, mlm, transformer  # noqa: F401
