"""The process a run lives in: device and threads (device), torchrun ranks (dist), the memory a device can give a run
now (free_memory), one GPU per sweep job (gpus), stop signals (signals), a sweep stopped as one (sweep_stop), one
training process per run folder (runlock), the benchmarks' two timers (timers), and wandb behind one object (tracking).

Imports nothing of posbench outside this wing: every other wing may use it. Start with device.py and dist.py.
"""
