"""Test double: the one name TorchScale 0.3.0 imports from timm."""
