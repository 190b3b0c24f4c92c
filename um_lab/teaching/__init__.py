"""The teaching experiments: Unified Memory basics, the paper's three data types, and the simulator against the GPU."""
