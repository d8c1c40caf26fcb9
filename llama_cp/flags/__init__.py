"""What is done with a :class:`~llama_cp.config.TrainConfig` besides holding its fields: flags and
YAML presets read into it (reading), ``--help`` and docs/flags.md's table written from its fields'
docstrings (help), its values checked before anything is built (checks), and its auto values
resolved by run (defaults). Each function takes the config class or config it works on, so this
layer never imports ``llama_cp/config.py``, which delegates to it."""
