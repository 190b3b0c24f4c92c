"""The simulated backend: a calibrated Unified Memory model that runs on the CPU."""
