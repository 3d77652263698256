"""Tools beside the product: the performance model and the advisor (``python -m
hvdsync.tools.advise``, docs/at-scale.md). Nothing of the product imports them."""
