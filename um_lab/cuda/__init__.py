"""The real backend: managed-memory pools hot-swapped into a live PyTorch CUDA session."""
