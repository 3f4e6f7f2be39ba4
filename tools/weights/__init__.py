"""Dev tooling for the shipped `tiny-*` checkpoints (run from a clone; not installed with longserve).

    python -m tools.weights.build_tiny_<name>   a seeded random checkpoint, rebuilt byte for byte on the same machine
    python -m tools.weights.train_tiny_<name>   a checkpoint trained on the procedural clips of `clips.py`
    python -m tools.weights.eval_tiny_<name>    what a trained checkpoint draws

Each writes into `weights/` by default (`--out DIR` elsewhere); the runtime reads the result through
`weights.registry.TINY_MODELS`. A new family's tiny checkpoint is a `build_tiny_<name>.py` here (seeded with
`weights.seeded`), its entry in `TINY_MODELS` and `REBUILD_COMMANDS`, and a rebuild test in `tests/weights/`
(`tests/support/checkpoints.py` compares the result with the shipped files). weights/README.md documents each.
"""
