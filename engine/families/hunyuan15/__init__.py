"""HunyuanVideo-1.5 (`HunyuanVideo15Pipeline`, `HunyuanVideo15ImageToVideoPipeline`), declared in `family.py`: its
rules on the coordinator (`rules.py`), and on the workers its encoder and loop (`worker.py`), its shard plan
(`plan.py`) and its VAE path (`vae.py`)."""
