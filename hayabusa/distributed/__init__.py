"""Multi-process execution: parallel config and checks (config.py), process groups and the collectives the model
layers call (parallel_state.py)."""
