"""Test double: the two names TorchScale 0.3.0 imports from fairscale (not installable offline here)."""
