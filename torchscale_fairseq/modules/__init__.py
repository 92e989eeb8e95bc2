"""Plain PyTorch building blocks: attention, feed-forward, positions, backbone scaling, MoE."""
