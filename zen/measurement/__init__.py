"""Measurement: what the cost model is fed on a real group.

    store        each group's Profile (set or probed) and the codec that carries it between ranks
    probe        the network probe: fixed costs and rates of zen's primitives, into one agreed Profile
    kernels      the kernel probe: the model's local terms from zen's own kernels, every rank at once
    calibration  what each registered scheme's formula misses on real calls (runs the schemes directly)
    workload     a tensor's Workload: nnz, hash and block loads, the exact union by bitmap doubling
    timing       calls timed from a quiet common start, from the last rank's start to the last one's end
"""
