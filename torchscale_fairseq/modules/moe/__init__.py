"""Sparse mixture-of-experts (X-MoE, GShard/Switch, expert choice): routers, capacity,
index-based dispatch, grouped experts (no capacity padding), expert parallelism and the balance loss."""
