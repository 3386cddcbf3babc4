"""What a workdir holds between runs: Orbax checkpoints, the model record beside them, the
workdir lock. Training writes them; generation, serving, conversion and evaluation read them."""
