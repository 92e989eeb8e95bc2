"""Sparse mixture-of-experts (X-MoE, GShard/Switch, expert choice): routers, capacity,
index-based dispatch, batched experts, expert parallelism and the balance loss."""
