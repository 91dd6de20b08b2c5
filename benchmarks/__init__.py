"""Benchmarks, each a `python -m benchmarks.<name>` command whose results are in docs/benchmarks/:

    hardware      GEMMs at the 12B shapes, training steps (tokens/s, MFU), quantization share
                  (`make bench`; also the bench part of launch/gpu_check.sh)
    numerics      the NVFP4 quantizers and the emulated linear against torchao and a plain reference
    step_profile  where one demo training step's time goes, BF16 against emulated NVFP4
    memory        the dry run's memory plan against a measured CPU run
    data_loader   the data loader's throughput and the blend state's memory
    data_prepare  the tokenizing throughput of `python -m data.prepare`
    checkpoint_scaling  a checkpoint's save and load time and peak memory per data-parallel rank

Shared: machine.py (what the machine is and how loaded it was while a bench ran; every bench but
data_loader reports it, and the studies name the CPU with it), timing.py (interleaved medians,
section timers, Markdown tables; hardware and numerics) and part_timer.py (the step's parts,
hooked for the step profile and the hardware bench's quantization share only).
"""
