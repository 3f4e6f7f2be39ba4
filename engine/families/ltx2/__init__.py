"""LTX-2 (`LTX2Pipeline`, `LTX2ImageToVideoPipeline`): video with its sound, declared in `family.py`: its rules on
the coordinator (`rules.py`), and on the workers its encoder and guided loop (`worker.py`), its shard plan
(`plan.py`), its VAE and sound decode (`vae.py`), and every call into diffusers' LTX-2 pipeline internals in one
adapter (`pipeline_api.py`)."""
