"""The framework-neutral core: the technique interface and the ports an adapter provides, the
step pipeline, the plain exchange, the rulebook, layers, config checks and statistics
(docs/internals.md, "The code map"). It imports no technique and no adapter, neither torch nor
TensorFlow."""
