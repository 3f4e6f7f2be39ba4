"""The workers' main module: what a worker process runs as `__main__`, in place of the caller's.

multiprocessing's spawn and forkserver start methods re-run the starting process's main module in each new
process (a script's file, `python -m`'s module, `<stdin>`), so a script that calls
`VideoPipeline.from_pretrained` without `if __name__ == "__main__":` would start a pool again inside every
worker. `engine.startup.context` starts workers with this module as their main module instead, as torchrun
runs its own entry point in each rank: the caller's script is never imported in a worker, from a file,
`python -`, `python -c` or a notebook alike. CUDA workers are still spawned (a fresh interpreter, no driver
state inherited) and CPU workers still forked from the fork server (`engine/preload.py`).

Nothing here: the worker's code (`engine.pool._worker_main`) arrives pickled, as the Process target.
"""
