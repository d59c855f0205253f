"""`text-generation-launcher`: resolve flags, environment and model files into one LaunchConfig
(config.py), then spawn and supervise the shard processes and the router (cli.py, supervisor.py).

Imports router/ (its flags and defaults) and text_generation_common/; never torch.
"""
